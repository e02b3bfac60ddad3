"""A sleep with `wake_on` and a kernel SIGKILLed at each step of its life: one early wake and one rest delivery
(or, with `rest` cancel, one wake), no task run twice, the budget charged exactly once.

The kill comes from the TEST ONLY hook `SYSCALL_KERNEL_CRASH_AT=<step>` (kernel.io.crash), read at the step
itself. The slow tasks wait for a gate file outside their tree (`jail = "none"`), so whether they still run when
the early wake is taken is the test's choice, never a race: the gate opens only once the early wake is there.
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, committed_workspace, put_request, read_answer, wait_for

from channel.paths import workspace_key
from kernel.io.crash import CRASH_ENV

GPU_S = 3600
# Every step a sleep woken early passes, in order (kernel.io.crash.CRASH_STEPS and WAKE_ON_CRASH_STEPS): the
# rest's `gathered` comes after the gate is opened.
RUN_STEPS = ("recorded", "snapshot", "submit", "task_end", "early_gathered", "early_woken", "gathered")
CANCEL_STEPS = ("recorded", "snapshot", "submit", "task_end", "rest_cancel", "gathered")


def sleep_request(marks: Path, gate: Path, rest: str) -> dict[str, Any]:
    fail = f"echo run >> {marks}/fail; echo boom >&2; exit 3"
    slow = (
        f"echo run >> {marks}/slow.$SWEEP_INDEX; echo part > out.txt; "
        f"while [ ! -e {gate} ]; do sleep 0.05; done; echo whole > out.txt"
    )
    return {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "wake_on": "first-failure",
        "rest": rest,
        "launches": [
            {"name": "fail", "command": fail},
            {"name": "slow", "command": slow, "array": 2, "gpus": 1, "minutes": 5, "artifacts": ["out.txt"]},
        ],
    }


def killed_at(kernel: Kernel, ws: Path, step: str, request: dict[str, Any], gate: Path) -> None:
    """Start the kernel to die at `step`, commit the sleep, open the gate if the early wake comes first (the rest
    then ends, and its steps are reached), see the kernel SIGKILLed at `step`, start it again, and open the gate
    once the early wake is there."""
    kernel.start(env={CRASH_ENV: step})
    put_request(ws, "s1", request)
    proc = kernel.proc
    assert proc is not None
    early = ws / ".syscall" / "wakes" / "s1.json"
    wait_for(lambda: proc.poll() is not None or early.exists(), 60, "the kill or the early wake")
    if early.exists():
        gate.touch()
    assert proc.wait(60) == -9
    kernel.ensure_stopped()
    assert f"event=crash_injected step={step}" in kernel.log_text()
    kernel.start()
    wait_for(early.exists, 60, "the early wake")
    gate.touch()


def ledger(kernel: Kernel, ws: Path) -> tuple[Any, ...]:
    db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        key = workspace_key(ws.resolve())
        row = db.execute(
            "SELECT gpu_s, reserved_gpu_s, launches, sleeps FROM workspaces WHERE key=?", (key,)
        ).fetchone()
        (state,) = db.execute("SELECT state FROM sleeps WHERE workspace=? AND id='s1'", (key,)).fetchone()
        (stored,) = db.execute("SELECT wake_json FROM exec_sleeps WHERE workspace=?", (key,)).fetchone()
        return (*row, state, stored)
    finally:
        db.close()


def used_gpu_s(tasks: list[dict[str, Any]]) -> int:
    return sum(math.ceil(t["elapsed_s"] or 0) for t in tasks if t["launch"] == "slow")


@pytest.mark.parametrize("step", RUN_STEPS)
def test_an_early_wake_and_its_rest_survive_a_kill_at_each_step(tmp_path: Path, step: str) -> None:
    kernel = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\n[local]\nseconds_per_minute = 1.0\n')
    ws = committed_workspace(tmp_path / "ws")
    marks, gate = tmp_path / "marks", tmp_path / "gate"
    marks.mkdir()
    kernel.enroll(ws, "--launches", "10", "--sleeps", "5", "--gpu-hours", "1")
    wakes = ws / ".syscall" / "wakes"
    try:
        killed_at(kernel, ws, step, sleep_request(marks, gate, "run"), gate)
        wait_for((wakes / "s1.rest.md").exists, 60, "the rest wake")
        assert wait_for(lambda: read_answer(ws, "s1"), 10, "the answer")["type"] == "accepted"
        kernel.wait_log("event=woken ", 10)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()

    for name in ("fail", "slow.0", "slow.1"):
        assert (marks / name).read_text() == "run\n", f"{name} ran more than once (or never)"
    log = kernel.log_text()
    for event in ("gathered_early", "woken_early", "gathered", "woken"):
        assert log.count(f"event={event} ") == 1, event

    early = json.loads((wakes / "s1.json").read_bytes())
    assert early["part"] == "early"
    assert early["trigger"]["launch"] == "fail"
    # the slow tasks had not ended: started (RUNNING) or not seen started yet (PENDING)
    assert [(t["launch"], t["task"], t["state"].replace("PENDING", "RUNNING")) for t in early["tasks"]] == [
        ("fail", 0, "FAILED"),
        ("slow", 0, "RUNNING"),
        ("slow", 1, "RUNNING"),
    ]
    assert [(r["launch"], r["task"]) for r in early["rest_tasks"]] == [("slow", 0), ("slow", 1)]
    assert early["budget"]["reserved_gpu_hours"] > 0  # the rest's reservations are held while it runs
    assert "syscall wait s1" in (wakes / "s1.md").read_text()

    rest = json.loads((wakes / "s1.rest.json").read_bytes())
    assert rest["part"] == "rest"
    assert [(t["launch"], t["task"], t["state"]) for t in rest["tasks"]] == [
        ("fail", 0, "FAILED"),
        ("slow", 0, "COMPLETED"),
        ("slow", 1, "COMPLETED"),
    ]
    assert rest["tasks"][0] == early["tasks"][0]  # delivered once, by the early wake, and shown as it was
    for t in rest["tasks"][1:]:
        [art] = t["artifacts"]
        assert (ws / ".syscall" / art["delivered"]).read_bytes() == b"whole\n"
        assert art["partial"] is False

    gpu_s, reserved, launches, sleeps, state, stored = ledger(kernel, ws)
    assert (gpu_s, reserved, launches, sleeps) == (GPU_S - used_gpu_s(rest["tasks"]), 0, 10 - 2, 5 - 1)
    assert state == "woken"
    assert stored == (wakes / "s1.rest.json").read_bytes(), "the rest wake on disk is not the one recorded"
    budget = json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]
    assert budget == rest["budget"]
    assert budget["reserved_gpu_hours"] == 0


@pytest.mark.parametrize("step", CANCEL_STEPS)
def test_a_wake_whose_rest_is_cancelled_survives_a_kill_at_each_step(tmp_path: Path, step: str) -> None:
    kernel = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\n[local]\nseconds_per_minute = 1.0\n')
    ws = committed_workspace(tmp_path / "ws")
    marks, gate = tmp_path / "marks", tmp_path / "gate"
    marks.mkdir()
    kernel.enroll(ws, "--launches", "10", "--sleeps", "5", "--gpu-hours", "1")
    wakes = ws / ".syscall" / "wakes"
    try:
        # The gate opens only once the wake is there: the slow tasks end by their cancel alone.
        kernel.start(env={CRASH_ENV: step})
        put_request(ws, "s1", sleep_request(marks, gate, "cancel"))
        assert kernel.proc is not None
        assert kernel.proc.wait(60) == -9
        kernel.ensure_stopped()
        assert f"event=crash_injected step={step}" in kernel.log_text()
        kernel.start()
        wait_for((wakes / "s1.md").exists, 60, "the wake")
        kernel.wait_log("event=woken ", 10)
        gate.touch()
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()

    assert (marks / "fail").read_text() == "run\n"
    for name in ("slow.0", "slow.1"):  # cancelled, perhaps before they started; never run twice
        assert not (marks / name).exists() or (marks / name).read_text() == "run\n", name
    log = kernel.log_text()
    assert log.count("event=gathered ") == 1
    assert log.count("event=woken ") == 1
    assert "event=gathered_early" not in log
    assert log.count("event=rest_cancelling ") == 1
    assert not (wakes / "s1.rest.json").exists()

    wake = json.loads((wakes / "s1.json").read_bytes())
    assert (wake["part"], wake["rest"], wake["trigger"]["launch"]) == ("whole", "cancel", "fail")
    assert [(t["launch"], t["task"], t["state"]) for t in wake["tasks"]] == [
        ("fail", 0, "FAILED"),
        ("slow", 0, "CANCELLED"),
        ("slow", 1, "CANCELLED"),
    ]
    assert [(r["launch"], r["task"]) for r in wake["rest_tasks"]] == [("slow", 0), ("slow", 1)]
    for t in wake["tasks"][1:]:
        assert all(a["partial"] for a in t["artifacts"])
    gpu_s, reserved, launches, sleeps, state, stored = ledger(kernel, ws)
    assert (gpu_s, reserved, launches, sleeps) == (GPU_S - used_gpu_s(wake["tasks"]), 0, 10 - 2, 5 - 1)
    assert state == "woken"
    assert stored == (wakes / "s1.json").read_bytes()
