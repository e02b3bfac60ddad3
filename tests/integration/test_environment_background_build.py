"""Builds never block an answer: a real kernel with bwrap, the real uv, a local HTTPS index (tests/localindex.py)
whose wheel download is held until the test lets it go, so the build takes as long as the test needs.

- A sleep on a lock with no built environment is answered `accepted` while the build is still waiting for its
  wheel (the index has served nothing yet), saying `building the environment for uv.lock (sha256 ...)`; its
  tasks have no job ids; `status` shows the build, `tail` shows uv's output (stream `environment`).
- A second workspace with the same lock, slept meanwhile, shares the one build (one wheel download, one
  `environment_built`); once the wheel is let go both sleeps run and import the package.
- A sleep cancelled while its environment builds wakes at once (its tasks CANCELLED, their reservation
  refunded) and nothing of it is submitted when the build is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, run_tool, wait_for
from localindex import Index, make_tls, make_wheel, uv_lock
from testenv import need

from channel.paths import workspace_key

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

PYTHON = "/usr/bin/python3"
PYPROJECT = '[project]\nname = "exp"\nversion = "0.1.0"\ndependencies = ["slowpkg==1.0"]\n'
PROBE = "import slowpkg; print('slowpkg', slowpkg.VALUE)"


class Setup:
    def __init__(self, kernel: Kernel, spaces: dict[str, Path], index: Index, lock: str) -> None:
        self.kernel = kernel
        self.spaces = spaces
        self.index = index
        self.lock = lock

    def tool(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        return run_tool(self.spaces[name], *args, timeout=180)

    def ok(self, name: str, *args: str) -> str:
        done = self.tool(name, *args)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
        return done.stdout

    def json(self, name: str, *args: str) -> dict[str, Any]:
        return json.loads(self.ok(name, *args, "--json"))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Setup]:
    need("python3 at /usr/bin/python3", os.path.exists(PYTHON), "the jobs' interpreter")
    tmp = tmp_path_factory.mktemp("envbg")
    ca, context = make_tls(tmp)
    index = Index(context, {"slowpkg": make_wheel("slowpkg", "1.0", {"slowpkg/__init__.py": "VALUE = 7\n"})})
    kernel = Kernel(
        tmp,
        f'jail = "bwrap"\n[environment]\npython = "{PYTHON}"\nindex_url = "{index.url}/simple"\n',
    )
    try:
        lock = uv_lock(tmp, PYPROJECT, index.url, ca, PYTHON)
        spaces = {}
        other = PYPROJECT.replace('version = "0.1.0"', 'version = "0.2.0"')
        lock2 = uv_lock(tmp, other, index.url, ca, PYTHON)  # another lock: another build
        for name in ("first", "second", "third"):
            files = {"README": f"{name}\n", "pyproject.toml": PYPROJECT, "uv.lock": lock}
            if name == "third":
                files |= {"pyproject.toml": other, "uv.lock": lock2}
            spaces[name] = make_workspace(tmp / "spaces" / name, files)
            kernel.enroll(spaces[name], "--launches", "10", "--sleeps", "10", "--gpu-hours", "1")
        index.reset()
        kernel.start(env={"SSL_CERT_FILE": str(ca), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
        yield Setup(kernel, spaces, index, lock)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        index.close()


def test_a_sleep_is_answered_while_its_environment_builds_and_runs_once_it_is_built(setup: Setup) -> None:
    sha = hashlib.sha256(setup.lock.encode()).hexdigest()
    setup.index.gate.clear()  # every wheel download waits from here
    setup.ok("first", "launch", "--name", "probe", "--", f'python -c "{PROBE}"')
    ans = setup.json("first", "sleep")
    assert ans["type"] == "accepted"
    assert setup.index.served == 0, "the answer came before the build had its wheel"
    assert ans["building"]["lock_sha256"] == sha
    assert ans["building"]["state"] == "building"
    assert [j["job_id"] for j in ans["jobs"]] == [None]

    # The other workspace, same lock: its answer says so in words, and it waits for the same build.
    setup.ok("second", "launch", "--name", "probe", "--", f'python -c "{PROBE}"')
    text = setup.ok("second", "sleep")
    assert f"building the environment for uv.lock (sha256 {sha[:12]})" in text, text
    assert setup.index.served == 0

    # `status` shows the build (begun: its wheel asked for), `tail` uv's output so far.
    wait_for(lambda: setup.index.asked >= 1, 60, "uv to ask for the wheel")
    view = setup.json("first", "status")["answer"]["sleep"]
    assert view["state"] == "snapshotted"
    assert view["environment"]["state"] == "building"
    assert view["environment"]["lock_sha256"] == sha
    assert view["environment"]["started_at"] is not None
    status_text = setup.ok("first", "status")
    assert f"Environment: building the environment for uv.lock (sha256 {sha[:12]}) since" in status_text
    tail = setup.json("first", "tail", "probe")
    assert tail["stream"] == "environment"
    assert tail["state"] == "PENDING"
    assert "environment build" in setup.ok("first", "tail", "probe")

    # The progress file `wait` watches carries the build (no request asked), and `wait` says each step of it.
    progress = setup.spaces["first"] / ".syscall" / "results" / str(ans["sleep_seq"]) / "progress.json"
    env = json.loads(progress.read_text())["environment"]
    assert (env["state"], env["lock_sha256"], env["log_tail"]) == ("building", sha, ""), env
    assert env["started_at"] == view["environment"]["started_at"]
    said = setup.kernel.dir / "wait-first.err"
    with said.open("w") as err:
        waiter = subprocess.Popen(
            [sys.executable, ".syscall/syscall", "wait", ans["id"], "--json", "--timeout", "170"],
            cwd=setup.spaces["first"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        wait_for(lambda: "Environment: building" in said.read_text(), 30, "wait to say the build")
        setup.index.gate.set()
        first_wake = json.loads(waiter.communicate(timeout=170)[0])
    lines = said.read_text()
    assert (
        f"Environment: building the environment for uv.lock (sha256 {sha[:12]}) since {env['started_at']}; "
        in lines
    ), lines
    assert f"Environment: the environment for uv.lock (sha256 {sha[:12]}) is built; " in lines, lines
    assert waiter.returncode == 0, lines
    assert json.loads(progress.read_text())["environment"]["state"] == "ready"
    for name in ("first", "second"):
        wake = first_wake if name == "first" else setup.json(name, "wait", "--timeout", "170")
        [t] = wake["tasks"]
        assert t["state"] == "COMPLETED", t
        assert "slowpkg 7" in t["stdout_tail"]
        assert wake["error"] is None
    assert setup.index.served == 1, "one build for both workspaces"
    log = setup.kernel.log_text()
    assert log.count("event=environment_built ") == 1
    # the next sleep finds the environment warm: answered with job ids, no build
    setup.ok("first", "launch", "--name", "again", "--", f'python -c "{PROBE}"')
    again = setup.json("first", "sleep")
    assert "building" not in again
    assert all(j["job_id"] for j in again["jobs"])
    setup.json("first", "wait", "--timeout", "170")


def test_a_sleep_cancelled_while_its_environment_builds_wakes_and_is_never_submitted(setup: Setup) -> None:
    setup.index.gate.clear()
    setup.index.reset()
    before = json.loads((setup.spaces["third"] / ".syscall" / "budget.json").read_text())["budget"]
    setup.ok("third", "launch", "--name", "never", "--gpus", "1", "--minutes", "30", "--", "echo ran")
    ans = setup.json("third", "sleep")
    assert ans["building"]["state"] == "building"
    wait_for(lambda: setup.index.asked >= 1, 60, "uv to ask for the wheel")
    cancelled = setup.json("third", "cancel")
    assert [(j["launch"], j["task"]) for j in cancelled["cancelled"]] == [("never", 0)]
    wake = setup.json("third", "wait", "--timeout", "60")
    [t] = wake["tasks"]
    assert (t["state"], t["job_id"]) == ("CANCELLED", None)
    assert wake["error"] is None
    assert wake["budget"]["reserved_gpu_hours"] == 0
    assert wake["budget"]["gpu_hours"] == before["gpu_hours"]
    built = setup.kernel.log_text().count("event=environment_built ")
    setup.index.gate.set()
    setup.kernel.wait_log("event=environment_built ", 120, count=built + 1)
    # the next sleep runs on the environment just built; the cancelled one never ran
    setup.ok("third", "launch", "--name", "after", "--", f'python -c "{PROBE}"')
    setup.json("third", "sleep")
    [after] = setup.json("third", "wait", "--timeout", "170")["tasks"]
    assert after["state"] == "COMPLETED", after
    runs = setup.kernel.state / "runs" / workspace_key(setup.spaces["third"].resolve())
    assert not list(runs.glob("*/never")), "a cancelled sleep's launch was submitted"
