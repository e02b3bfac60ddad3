"""A kernel killed with SIGKILL mid-burst and restarted answers every request exactly once, budgets exact."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernelproc import Kernel, answer_path, git_workspace, put_request, status, wait_for

WORKSPACES = 4
PER_WORKSPACE = 150


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(tmp_path, 'rescan_seconds = 1\nbatch_per_workspace = 4\nbackend = "none"\n')
    yield k
    k.ensure_stopped()


def answered(spaces: list[Path]) -> int:
    return sum(len(os.listdir(ws / ".syscall" / "answers")) for ws in spaces)


def test_sigkill_mid_burst_then_restart_answers_each_request_once(kernel: Kernel, tmp_path: Path) -> None:
    spaces = [git_workspace(tmp_path / f"ws{i}") for i in range(WORKSPACES)]
    for ws in spaces:
        kernel.enroll(ws, "--launches", "10", "--sleeps", "5", "--gpu-hours", "3")
    expected: dict[tuple[str, str], str] = {}
    for ws in spaces:
        for n in range(PER_WORKSPACE):
            rid = f"r{n:04d}"
            if n == PER_WORKSPACE // 2:
                launch = {"name": "t", "command": "true", "gpus": 1, "minutes": 60, "array": 2}
                put_request(ws, rid, {"protocol": 1, "id": rid, "type": "sleep", "launches": [launch]})
                expected[(ws.name, rid)] = "accepted"
            elif n % 10 == 3:
                put_request(ws, rid, {"protocol": 1, "id": rid, "type": "history"})
                expected[(ws.name, rid)] = "history"
            else:
                put_request(ws, rid, status(rid))
                expected[(ws.name, rid)] = "status"
    total = len(expected)

    for kill_at in (total // 6, total // 2):
        kernel.start(wait_ready=False)
        wait_for(lambda at=kill_at: answered(spaces) >= at, 60, f"{kill_at} answers")
        kernel.kill()
        assert answered(spaces) < total, "the kill came after the burst; make the burst larger"

    kernel.start()
    wait_for(lambda: answered(spaces) >= total, 120, "every answer")
    wait_for(
        lambda: all(not os.listdir(ws / ".syscall" / "requests") for ws in spaces),
        30,
        "empty request directories",
    )
    assert kernel.stop() == 0

    db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
    keys = dict(db.execute("SELECT path, key FROM workspaces"))
    for ws in spaces:
        answers = ws / ".syscall" / "answers"
        assert sorted(os.listdir(answers)) == sorted(
            f"{rid}.json" for (name, rid) in expected if name == ws.name
        )
        key = keys[str(ws)]
        stored = dict(db.execute("SELECT id, answer FROM requests WHERE workspace = ?", (key,)))
        assert len(stored) == PER_WORKSPACE
        for rid, answer in stored.items():
            on_disk = (answers / f"{rid}.json").read_bytes()
            assert on_disk == answer, f"{ws.name}/{rid}: the file is not the one recorded answer"
            assert json.loads(on_disk)["type"] == expected[(ws.name, rid)]
        sleeps = db.execute("SELECT count(*) FROM sleeps WHERE workspace = ?", (key,)).fetchone()[0]
        assert sleeps == 1
        launches, n_sleeps, gpu_s, reserved = db.execute(
            "SELECT launches, sleeps, gpu_s, reserved_gpu_s FROM workspaces WHERE key = ?", (key,)
        ).fetchone()
        assert (launches, n_sleeps, gpu_s, reserved) == (9, 4, 3600, 7200)
        budget = json.loads((ws / ".syscall" / "budget.json").read_bytes())["budget"]
        assert budget == {"launches": 9, "sleeps": 4, "gpu_hours": 1.0, "reserved_gpu_hours": 2.0}
    db.close()


@pytest.mark.parametrize("verb", ["status", "sleep"])
def test_an_answer_torn_by_a_power_cut_is_replaced_by_the_recorded_one(
    kernel: Kernel, tmp_path: Path, verb: str
) -> None:
    """An answer is shown before its fsyncs and its request is removed only after them: a power cut in between
    can leave the file torn (empty) with its request still in place. The next start replays the recorded answer
    over it, byte for byte, and only then removes the request. The power cut is staged: the request put back
    with the same bytes, the answer file emptied."""
    ws = git_workspace(tmp_path / "ws")
    kernel.enroll(ws, "--launches", "10", "--sleeps", "5", "--gpu-hours", "3")
    rid = "torn1"
    body = (
        status(rid)
        if verb == "status"
        else {"protocol": 1, "id": rid, "type": "sleep", "launches": [{"name": "t", "command": "true"}]}
    )
    data = json.dumps(body).encode()
    kernel.start()
    put_request(ws, rid, data)
    wait_for(lambda: not (ws / ".syscall" / "requests" / f"{rid}.json").exists(), 30, "the request removed")
    first = answer_path(ws, rid).read_bytes()
    assert kernel.stop() == 0

    put_request(ws, rid, data)
    answer_path(ws, rid).write_bytes(b"")
    kernel.start()
    wait_for(lambda: not (ws / ".syscall" / "requests" / f"{rid}.json").exists(), 30, "the request removed")
    assert answer_path(ws, rid).read_bytes() == first
    assert kernel.stop() == 0
    assert "outcome=replayed" in kernel.log_text()
