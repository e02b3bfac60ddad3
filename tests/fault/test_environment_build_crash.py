"""A kernel SIGKILLed while a sleep's environment is built in the background, then restarted: the sleep is built
and run, or woken with the build's failure; one wake, the budget exact.

The real uv builds from a local HTTPS index (tests/localindex.py) whose wheel download is held while the test
kills the kernel, so the kill lands mid-build; or `SYSCALL_KERNEL_CRASH_AT=build` kills it where the build
begins. The dead kernel's build is found stale (its flock died with it, its builder record did not) and done
again. `jail = "none"`: these tests are about the kernel's bookkeeping; the build jail has its own tests.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, put_request, read_answer, wait_for
from localindex import Index, make_tls, make_wheel, uv_lock

from channel.paths import workspace_key
from kernel.io.crash import CRASH_ENV

pytestmark = [pytest.mark.slow]

PYTHON = "/usr/bin/python3"
PYPROJECT = '[project]\nname = "exp"\nversion = "0.1.0"\ndependencies = ["slowpkg==1.0"]\n'
GPU_S = 3600
LAUNCHES, SLEEPS = 10, 5


@dataclass
class World:
    tmp: Path
    index: Index
    kernel: Kernel
    ws: Path
    env: dict[str, str]

    def budget(self) -> dict[str, Any]:
        return json.loads((self.ws / ".syscall" / "budget.json").read_text())["budget"]  # type: ignore[no-any-return]

    def store_row(self) -> tuple[int, int, str]:
        db = sqlite3.connect(f"file:{self.kernel.state / 'state.sqlite'}?mode=ro", uri=True)
        try:
            key = workspace_key(self.ws.resolve())
            gpu_s, reserved = db.execute(
                "SELECT gpu_s, reserved_gpu_s FROM workspaces WHERE key=?", (key,)
            ).fetchone()
            (state,) = db.execute("SELECT state FROM sleeps WHERE workspace=? AND id='s1'", (key,)).fetchone()
            return gpu_s, reserved, state
        finally:
            db.close()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    if not Path(PYTHON).exists():
        pytest.skip("python3 at /usr/bin/python3 is the environments' interpreter")
    ca, context = make_tls(tmp_path)
    index = Index(context, {"slowpkg": make_wheel("slowpkg", "1.0", {"slowpkg/__init__.py": "VALUE = 7\n"})})
    kernel = Kernel(
        tmp_path,
        f'jail = "none"\nrescan_seconds = 1\n[local]\nseconds_per_minute = 1.0\n'
        f'[environment]\npython = "{PYTHON}"\nindex_url = "{index.url}/simple"\n',
    )
    try:
        lock = uv_lock(tmp_path, PYPROJECT, index.url, ca, PYTHON)
        ws = make_workspace(tmp_path / "ws", {"pyproject.toml": PYPROJECT, "uv.lock": lock})
        kernel.enroll(ws, "--launches", str(LAUNCHES), "--sleeps", str(SLEEPS), "--gpu-hours", "1")
        index.reset()
        env = {"SSL_CERT_FILE": str(ca), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        yield World(tmp_path, index, kernel, ws, env)
    finally:
        kernel.ensure_stopped()
        index.close()


REQUEST = {
    "protocol": 1,
    "id": "s1",
    "type": "sleep",
    "launches": [
        {
            "name": "probe",
            "command": "python -c 'import slowpkg; print(slowpkg.VALUE)'",
            "gpus": 1,
            "minutes": 5,
        }
    ],
}


def finish(w: World) -> dict[str, Any]:
    """Restart the kernel (the index answering) and return the one wake."""
    w.index.gate.set()
    w.kernel.start(env=w.env)
    wake_file = w.ws / ".syscall" / "wakes" / "s1.json"
    wait_for(wake_file.exists, 120, "the wake")
    wait_for(lambda: (w.ws / ".syscall" / "wakes" / "s1.md").exists(), 10, "the markdown wake")
    w.kernel.wait_log("event=woken", 10)
    answer = wait_for(lambda: read_answer(w.ws, "s1"), 10, "the answer")
    assert answer["type"] == "accepted"
    assert w.kernel.stop() == 0
    log = w.kernel.log_text()
    assert log.count("event=gathered ") == 1
    assert log.count("event=woken ") == 1
    return json.loads(wake_file.read_bytes())  # type: ignore[no-any-return]


def ran(w: World, wake: dict[str, Any]) -> None:
    """The sleep ran once, after its environment was built again, and was charged exactly once."""
    [t] = wake["tasks"]
    assert t["state"] == "COMPLETED", t
    assert t["stdout_tail"].strip() == "7"
    assert "event=environment_build_stale " in w.kernel.log_text(), "the dead kernel's build was done again"
    used = math.ceil(t["elapsed_s"])
    assert w.store_row() == (GPU_S - used, 0, "woken")
    budget = w.budget()
    assert (budget["launches"], budget["sleeps"], budget["reserved_gpu_hours"]) == (
        LAUNCHES - 1,
        SLEEPS - 1,
        0,
    )
    assert budget == wake["budget"]


def test_a_kernel_killed_mid_build_builds_again_at_restart_and_runs_the_sleep_once(world: World) -> None:
    world.index.gate.clear()
    world.kernel.start(env=world.env)
    put_request(world.ws, "s1", REQUEST)
    answer = wait_for(lambda: read_answer(world.ws, "s1"), 30, "the answer")
    assert answer["building"]["state"] == "building"
    wait_for(lambda: world.index.asked >= 1, 60, "uv to ask for the wheel")
    world.kernel.kill()  # SIGKILL, uv mid-download
    ran(world, finish(world))


def test_a_kernel_killed_where_the_build_begins_builds_at_restart_and_runs_the_sleep_once(
    world: World,
) -> None:
    world.kernel.start(env={**world.env, CRASH_ENV: "build"})
    put_request(world.ws, "s1", REQUEST)
    assert world.kernel.proc is not None
    assert world.kernel.proc.wait(60) == -9
    world.kernel.ensure_stopped()
    assert "event=crash_injected step=build" in world.kernel.log_text()
    ran(world, finish(world))


def test_a_kernel_killed_mid_build_whose_build_then_fails_wakes_the_sleep_refunded_exactly(
    world: World,
) -> None:
    world.index.gate.clear()
    world.kernel.start(env=world.env)
    put_request(world.ws, "s1", REQUEST)
    wait_for(lambda: read_answer(world.ws, "s1"), 30, "the answer")
    wait_for(lambda: world.index.asked >= 1, 60, "uv to ask for the wheel")
    world.kernel.kill()
    world.index.wheels.clear()  # the wheel is gone from the index: the build at restart fails
    wake = finish(world)
    assert wake["error"]["code"] == "environment.failed"
    assert "slowpkg" in wake["error"]["message"]
    assert [t["state"] for t in wake["tasks"]] == ["CANCELLED"]
    assert world.store_row() == (GPU_S, 0, "woken")
    budget = world.budget()
    assert (budget["launches"], budget["sleeps"], budget["reserved_gpu_hours"]) == (LAUNCHES, SLEEPS, 0)
    assert budget == wake["budget"]
