"""kernel.service.gather: exit records -> task states, and output tails (pure logic and real files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from channel import limits as L
from channel.lifecycle import TaskEvent, next_task_state
from kernel.backends.jobscript import ExitRecord
from kernel.service import gather


@pytest.mark.parametrize(
    ("rec", "state", "code", "sig"),
    [
        (ExitRecord(0, "exited"), "COMPLETED", 0, None),
        (ExitRecord(7, "exited"), "FAILED", 7, None),
        (ExitRecord(137, "signaled", signal="SIGKILL"), "FAILED", 137, 9),
        (ExitRecord(123, "timeout", signal="SIGUSR2", command_code=143), "TIMEOUT", 123, 12),
        (ExitRecord(122, "terminated", signal="SIGTERM"), "CANCELLED", 122, 15),
        (ExitRecord(122, "cancelled"), "CANCELLED", None, None),
        (ExitRecord(120, "empty_command"), "FAILED", 120, None),
        (ExitRecord(121, "materialise_failed"), "FAILED", 121, None),
        (ExitRecord(124, "wrapper_error"), "FAILED", 124, None),
        (ExitRecord(125, "lost"), "VANISHED", None, None),
        (ExitRecord(1, "something-new", signal="NOT-A-SIGNAL"), "FAILED", 1, None),
    ],
)
def test_every_exit_kind_maps_to_a_legal_final_state(
    rec: ExitRecord, state: str, code: int | None, sig: int | None
) -> None:
    out = gather.outcome(rec)
    assert (out.state, out.exit_code, out.signal) == (state, code, sig)
    # The lifecycle table accepts the move from both live states.
    for live in ("PENDING", "RUNNING"):
        assert next_task_state(live, out.event, out.state) == state
    assert (out.hint is None) == (state in ("COMPLETED", "TIMEOUT") or rec.kind == "terminated")
    expected = {"CANCELLED": TaskEvent.CANCEL, "VANISHED": TaskEvent.LOSE}.get(state, TaskEvent.FINISH)
    assert out.event is expected


def test_tail_keeps_the_last_characters_and_replaces_bad_bytes(tmp_path: Path) -> None:
    f = tmp_path / "stdout"
    f.write_bytes(b"x" * 100_000 + b"\xff\xfe" + "é".encode() * 10 + b"end\n")
    got = gather.tail(f)
    assert len(got) == L.TAIL_MAX_CHARS
    assert got.endswith("\ufffd\ufffd" + "é" * 10 + "end\n")
    assert gather.tail(tmp_path / "missing") == ""
    short = tmp_path / "short"
    short.write_bytes(b"hello\n")
    assert gather.tail(short) == "hello\n"


def test_gpu_seconds_used_rounds_up_and_ignores_cpu_jobs() -> None:
    assert gather.gpu_seconds_used(2, 1.2) == 3
    assert gather.gpu_seconds_used(0, 100.0) == 0
    assert gather.gpu_seconds_used(1, None) == 0
