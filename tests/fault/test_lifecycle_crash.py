"""A kernel SIGKILLed at each step of a sleep's lifecycle, then restarted: one wake, no task run twice.

The crash comes from the TEST ONLY hook `SYSCALL_KERNEL_CRASH_AT=<step>` (kernel.io.crash.CRASH_STEPS), read at
the step itself, so the kill lands exactly there rather than at a time that only usually falls there. Jobs count
their runs by appending to marker files outside their tree, which needs `jail = "none"`: these tests are about
the kernel's bookkeeping; the jail has its own tests.
"""

from __future__ import annotations

import functools
import json
import math
import sqlite3
from pathlib import Path

import pytest
from kernelproc import Kernel, committed_workspace, put_request, read_answer, wait_for

from channel.paths import workspace_key
from kernel.io.crash import CRASH_ENV, CRASH_STEPS

GPU_S = 3600


def killed_then_restarted(
    kernel: Kernel, ws: Path, step: str, requests: dict[str, dict[str, object]]
) -> None:
    """Start the kernel to die at `step`, commit `requests` (id -> body, in order), see it SIGKILLed there, and
    start it again."""
    kernel.start(env={CRASH_ENV: step})
    for rid, body in requests.items():
        put_request(ws, rid, body)
    assert kernel.proc is not None
    assert kernel.proc.wait(30) == -9
    kernel.ensure_stopped()
    assert f"event=crash_injected step={step}" in kernel.log_text()
    kernel.start()


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_a_kernel_killed_at_a_step_delivers_one_wake_and_runs_no_task_twice(
    tmp_path: Path, step: str
) -> None:
    kernel = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\n[local]\nseconds_per_minute = 1.0\n')
    ws = committed_workspace(tmp_path / "ws")
    marks = tmp_path / "marks"
    marks.mkdir()
    kernel.enroll(ws, "--launches", "10", "--sleeps", "5", "--gpu-hours", "1")
    quick = f"echo run >> {marks}/quick; echo made > out.txt"
    slow = f'echo run >> {marks}/slow.$SWEEP_INDEX; sleep 1; echo "slow $SWEEP_INDEX"'
    request = {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "launches": [
            {"name": "quick", "command": quick, "artifacts": ["out.txt"]},
            {"name": "slow", "command": slow, "array": 2, "gpus": 1, "minutes": 5},
        ],
    }
    try:
        killed_then_restarted(kernel, ws, step, {"s1": request})
        wake_file = ws / ".syscall" / "wakes" / "s1.json"
        wait_for(wake_file.exists, 30, "the wake")
        answer = wait_for(lambda: read_answer(ws, "s1"), 10, "the answer")
        wait_for(lambda: (ws / ".syscall" / "wakes" / "s1.md").exists(), 10, "the markdown wake")
        kernel.wait_log("event=woken", 10)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()

    assert answer["type"] == "accepted"
    assert [(j["launch"], j["task"]) for j in answer["jobs"]] == [("quick", 0), ("slow", 0), ("slow", 1)]
    assert all(j["job_id"] for j in answer["jobs"])
    for name in ("quick", "slow.0", "slow.1"):
        assert (marks / name).read_text() == "run\n", f"{name} ran more than once (or never)"

    wake = json.loads(wake_file.read_bytes())
    assert [(t["launch"], t["task"], t["state"]) for t in wake["tasks"]] == [
        ("quick", 0, "COMPLETED"),
        ("slow", 0, "COMPLETED"),
        ("slow", 1, "COMPLETED"),
    ]
    [art] = wake["tasks"][0]["artifacts"]
    assert (ws / ".syscall" / art["delivered"]).read_bytes() == b"made\n"
    log = kernel.log_text()
    assert log.count("event=gathered ") == 1
    assert log.count("event=woken ") == 1

    used = sum(math.ceil(t["elapsed_s"]) for t in wake["tasks"] if t["launch"] == "slow")
    db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        key = workspace_key(ws.resolve())
        gpu_s, reserved = db.execute(
            "SELECT gpu_s, reserved_gpu_s FROM workspaces WHERE key=?", (key,)
        ).fetchone()
        assert (gpu_s, reserved) == (GPU_S - used, 0)
        (state,) = db.execute("SELECT state FROM sleeps WHERE workspace=? AND id='s1'", (key,)).fetchone()
        assert state == "woken"
        (stored,) = db.execute("SELECT wake_json FROM exec_sleeps WHERE workspace=?", (key,)).fetchone()
        assert stored == wake_file.read_bytes(), "the wake on disk is not the one recorded"
    finally:
        db.close()
    budget = json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]
    assert budget == wake["budget"]
    assert budget["reserved_gpu_hours"] == 0


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_two_sleeps_in_flight_survive_a_kill_at_each_step(tmp_path: Path, step: str) -> None:
    """Two sleeps committed together (several in flight, issue 25), the kernel killed at `step` of whichever
    reaches it first: after the restart each sleep has one wake, each task ran once, and the budget is exact."""
    kernel = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\n[local]\nseconds_per_minute = 1.0\n')
    ws = committed_workspace(tmp_path / "ws")
    marks = tmp_path / "marks"
    marks.mkdir()
    kernel.enroll(ws, "--launches", "10", "--sleeps", "5", "--gpu-hours", "1")
    slow = f'echo run >> {marks}/slow.$SWEEP_INDEX; sleep 1; echo "slow $SWEEP_INDEX"'
    first = {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "launches": [
            {"name": "quick", "command": f"echo run >> {marks}/quick"},
            {"name": "slow", "command": slow, "array": 2, "gpus": 1, "minutes": 5},
        ],
    }
    other = f"echo run >> {marks}/other; sleep 1"
    second = {
        "protocol": 1,
        "id": "s2",
        "type": "sleep",
        "launches": [{"name": "other", "command": other, "gpus": 1, "minutes": 5}],
    }
    wakes = ws / ".syscall" / "wakes"
    try:
        killed_then_restarted(kernel, ws, step, {"s1": first, "s2": second})
        for rid in ("s1", "s2"):
            wait_for((wakes / f"{rid}.md").exists, 30, f"the wake of {rid}")
            assert wait_for(functools.partial(read_answer, ws, rid), 10, "the answer")["type"] == "accepted"
        kernel.wait_log("event=woken", 10, count=2)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()

    for name in ("quick", "slow.0", "slow.1", "other"):
        assert (marks / name).read_text() == "run\n", f"{name} ran more than once (or never)"
    log = kernel.log_text()
    assert log.count("event=gathered ") == 2
    assert log.count("event=woken ") == 2
    used = 0
    for rid in ("s1", "s2"):
        wake = json.loads((wakes / f"{rid}.json").read_bytes())
        assert all(t["state"] == "COMPLETED" for t in wake["tasks"]), wake["tasks"]
        used += sum(math.ceil(t["elapsed_s"]) for t in wake["tasks"] if t["launch"] != "quick")
    db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        key = workspace_key(ws.resolve())
        row = db.execute(
            "SELECT gpu_s, reserved_gpu_s, launches, sleeps FROM workspaces WHERE key=?", (key,)
        ).fetchone()
        assert row == (GPU_S - used, 0, 10 - 3, 5 - 2)
        states = db.execute("SELECT id, state FROM sleeps WHERE workspace=? ORDER BY seq", (key,)).fetchall()
        assert states == [("s1", "woken"), ("s2", "woken")]
    finally:
        db.close()
    budget = json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]
    assert budget["reserved_gpu_hours"] == 0
    assert budget["sleeps"] == 3
