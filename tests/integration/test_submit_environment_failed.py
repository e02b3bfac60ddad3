"""A submit whose environment build fails reaches no verdict, and so uses up none of the day's submits.

A real kernel (the local backend, `jail = "none"`: this is the kernel's bookkeeping; the build jail has its own
tests), the real uv and a local HTTPS index (tests/localindex.py) from which the lock's wheel is removed, so the
submit's background build fails. Its wake says `environment.failed`, that no verdict was reached and that it does
not count toward `max_submits_per_day` (1 here); the whole charge is refunded. The next submit, with the wheel
back, is accepted (before: refused `budget.submits_per_day`), runs and reaches a verdict; the one after that is
refused, since that one did count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, run_tool
from localindex import Index, make_tls, make_wheel, uv_lock

pytestmark = [pytest.mark.slow]

PYTHON = "/usr/bin/python3"
PYPROJECT = '[project]\nname = "exp"\nversion = "0.1.0"\ndependencies = ["slowpkg==1.0"]\n'
EVAL = 'python -c \'import json, slowpkg; print(json.dumps(json.load(open("result.txt")) | {"v": slowpkg.VALUE}))\''


@dataclass
class World:
    tmp: Path
    index: Index
    kernel: Kernel
    ws: Path

    def tool(self, *args: str) -> Any:
        done = run_tool(self.ws, *args, timeout=180)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
        return done

    def submit(self, score: float) -> Any:
        """Stage a submit of a tree scoring `score` and sleep on it: the tool's finished process."""
        (self.ws / "result.txt").write_text(json.dumps({"score": score}) + "\n")
        report = self.tmp / f"report-{score}.md"
        report.write_text(f"# try {score}\n")
        self.tool("submit", "--report", str(report))
        return run_tool(self.ws, "sleep", "--json", timeout=180)

    def budget(self) -> dict[str, Any]:
        return json.loads((self.ws / ".syscall" / "budget.json").read_text())["budget"]  # type: ignore[no-any-return]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    if not os.path.exists(PYTHON):
        pytest.skip("python3 at /usr/bin/python3 is the environments' interpreter")
    ca, context = make_tls(tmp_path)
    index = Index(context, {"slowpkg": make_wheel("slowpkg", "1.0", {"slowpkg/__init__.py": "VALUE = 7\n"})})
    kernel = Kernel(
        tmp_path,
        'jail = "none"\n[local]\nseconds_per_minute = 1.0\n[defaults]\nmax_submits_per_day = 1\n'
        f'[environment]\npython = "{PYTHON}"\nindex_url = "{index.url}/simple"\n',
    )
    try:
        lock = uv_lock(tmp_path, PYPROJECT, index.url, ca, PYTHON)
        files = {"pyproject.toml": PYPROJECT, "uv.lock": lock, "result.txt": '{"score": 0.5}\n'}
        ws = make_workspace(tmp_path / "ws", files)
        kernel.enroll(ws, "--sleeps", "10", "--gpu-hours", "4", "--eval-command", EVAL, "--metric", "score")
        kernel.start(env={"SSL_CERT_FILE": str(ca), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
        yield World(tmp_path, index, kernel, ws)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        index.close()


def test_a_submit_whose_environment_build_fails_reaches_no_verdict_and_is_not_counted(world: World) -> None:
    # What `submit --help` promises is what the rest of this test shows the kernel doing.
    promise = " ".join(world.tool("submit", "--help").stdout.split())
    assert (
        "limit: at most 1 submits accepted in any 24 hours (max_submits_per_day). An unjudged submit, one that "
        "reached no verdict because none of its evaluation runs ran (its environment build failed: its wake's "
        "error says why), does not count toward it, and its whole charge is refunded;" in promise
    ), promise
    before = world.budget()
    wheels = dict(world.index.wheels)
    world.index.wheels.clear()  # the lock's wheel is gone from the index: the build fails
    first = world.submit(0.6)
    assert first.returncode == 0, first.stdout + first.stderr
    accepted = json.loads(first.stdout)
    assert accepted["building"]["state"] == "building", accepted
    wake = json.loads(world.tool("wait", accepted["id"], "--json", "--timeout", "170").stdout)
    assert wake["error"]["code"] == "environment.failed", wake
    assert wake["verdict"] is None
    assert {t["state"] for t in wake["tasks"]} == {"CANCELLED"}
    assert wake["budget"] == before

    # The wheel back: the next submit is accepted, builds, runs and is judged; it is the day's one submit.
    world.index.wheels.update(wheels)
    second = world.submit(0.7)
    assert second.returncode == 0, second.stdout + second.stderr
    judged = json.loads(
        world.tool("wait", json.loads(second.stdout)["id"], "--json", "--timeout", "170").stdout
    )
    assert judged["error"] is None
    assert judged["verdict"]["outcome"] == "improved", judged
    third = world.submit(0.8)
    assert third.returncode != 0
    assert "budget.submits_per_day" in third.stdout + third.stderr
    assert (
        "at most 1 submits accepted in any 24 hours, and 1 counting toward it" in third.stdout + third.stderr
    )
    md = (world.ws / ".syscall" / "wakes" / f"{wake['id']}.md").read_text()
    assert (
        "No verdict was reached: none of the submit's evaluation runs ran, and this submit does not count "
        "toward the workspace's max_submits_per_day." in md
    ), md
