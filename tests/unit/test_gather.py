"""kernel.service.gather: exit records -> task states, and output tails (pure logic and real files)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from channel import limits as L
from channel import safefs
from channel.lifecycle import TaskEvent, next_task_state
from kernel.backends import jobscript
from kernel.backends.jobscript import ExitRecord
from kernel.backends.slurm import backend as S
from kernel.core import exits
from kernel.core.records import JobRow
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


def test_tail_is_whole_lines_cut_by_lines_and_bytes(tmp_path: Path) -> None:
    f = tmp_path / "stdout"
    f.write_bytes(b"".join(b"epoch %d loss 0.5\n" % i for i in range(1000)))
    got = gather.tail(f)
    assert got.splitlines() == [f"epoch {i} loss 0.5" for i in range(960, 1000)]  # 40 lines
    wide = tmp_path / "wide"
    wide.write_bytes(b"".join(b"%03d " % i + b"x" * 495 + b"\n" for i in range(100)))
    got = gather.tail(wide)
    assert len(got.encode()) <= L.TAIL_MAX_BYTES
    assert got.startswith("092 ")  # whole lines only: 8 lines of 500 bytes fit in 4000
    assert got.count("\n") == 8
    assert gather.tail(tmp_path / "missing") == ""
    short = tmp_path / "short"
    short.write_bytes(b"hello\n")
    assert gather.tail(short) == "hello\n"


def test_tail_of_one_huge_line_is_its_end_and_bad_bytes_are_replaced(tmp_path: Path) -> None:
    f = tmp_path / "stdout"
    f.write_bytes(b"x" * 100_000 + b"\xff\xfe" + "é".encode() * 10 + b"end")
    got = gather.tail(f)
    assert len(got.encode("utf-8", "surrogatepass")) <= L.TAIL_MAX_BYTES + 4
    assert got.endswith("\ufffd\ufffd" + "é" * 10 + "end")


def test_scan_counts_lines_and_finds_the_last_json_object_line(tmp_path: Path) -> None:
    f = tmp_path / "stdout"
    f.write_bytes(
        b"".join(b"step %d\n" % i for i in range(500))
        + b'{"lr": 0.001, "val_loss": 0.31}\n'
        + b"[1, 2]\n{not json}\n  \n"
    )
    scan = gather.scan_log(f)
    assert scan is not None
    assert (scan.size, scan.lines) == (f.stat().st_size, 504)
    assert scan.result == '{"lr": 0.001, "val_loss": 0.31}'
    assert scan.tail_lines == 40
    assert scan.tail_bytes == len(scan.tail.encode())
    no_newline = tmp_path / "nn"
    no_newline.write_bytes(b"a\nb")
    nn = gather.scan_log(no_newline)
    assert nn is not None
    assert (nn.lines, nn.tail_lines, nn.result) == (2, 2, None)
    (tmp_path / "link").symlink_to(f)
    assert gather.scan_log(tmp_path / "link") is None
    assert gather.scan_log(tmp_path / "missing") is None


def test_deliver_log_copies_the_whole_log_or_its_end_from_a_line_start(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    task_dir = tmp_path / "run"
    task_dir.mkdir()
    data = b"".join(b"line %04d\n" % i for i in range(1000))  # 10 bytes a line
    (task_dir / "stdout").write_bytes(data)
    job = JobRow("w-1", 3, "sweep", 1, 4, 0, "x", 10, 0, (), "", 0, "COMPLETED")
    with safefs.open_channel(ws, create=True) as ch:
        scan = gather.scan_log(task_dir / "stdout")
        whole = gather.deliver_log(ch, job, task_dir, "stdout", scan, 1 << 20)
        assert whole is not None
        assert whole.delivered == "results/3/sweep/1/stdout"
        assert whole.sha256 == hashlib.sha256(data).hexdigest()
        assert (ws / ".syscall/results/3/sweep/1/stdout").read_bytes() == data
        end = gather.deliver_log(ch, job, task_dir, "stdout", scan, 95)
        assert end is not None
        assert end.delivered_from == len(data) - 90  # 95 bytes back is mid-line: from the next line start
        assert (ws / ".syscall/results/3/sweep/1/stdout").read_bytes() == data[-90:]
        assert end.sha256 == hashlib.sha256(data[-90:]).hexdigest()


def test_the_wake_hint_follows_the_end_the_backend_reads(tmp_path: Path) -> None:
    """A command SIGKILLed by Slurm's memory limit: the wrapper recorded `signaled`, Slurm's state (recorded by the
    backend, with no reason text of its own) says OUT_OF_MEMORY, and the task was recorded OUT_OF_MEMORY through
    the backend's `outcome_of`. The wake's hint is that state's ("went over its memory limit"), not the record's
    ("killed by SIGKILL", which the old code showed beside the OUT_OF_MEMORY state)."""
    jobscript.write_exit(tmp_path, ExitRecord(137, "signaled", signal="SIGKILL"))
    S._write_json(tmp_path, S.STATE_FILE, S.TaskSlurmState("5", "OUT_OF_MEMORY"))
    out = S.outcome_of(tmp_path)
    assert out is not None
    assert out.state == "OUT_OF_MEMORY"
    job = JobRow("w-1", 3, "train", 0, 1, 0, "x", 10, 0, (), "", 0, out.state, exit_code=137, signal=9)
    hint = gather.end_hint(tmp_path, S.hint_of, S.outcome_of)
    got = gather.task_result(job, tmp_path, 1.0, gather.TaskFiles(hint=hint))
    assert (got.state, got.hint) == ("OUT_OF_MEMORY", exits.HINT_OOM)
    assert (
        gather.end_hint(tmp_path, S.hint_of) == "the command was killed by SIGKILL"
    )  # the exit record's row alone


@pytest.mark.parametrize(
    ("asked", "default", "hint"),
    [
        (
            64,
            4096,
            "the task went over its memory limit of 64 MB (its launch asked for it: `launch --mem`) and was "
            "killed; ask for more with `launch --mem MB` (this workspace allows up to 8192 MB per task, "
            "kernel.json policy.max_mem_mb), or use less memory, smaller batches or fewer workers",
        ),
        (
            None,
            4096,
            "the task went over its memory limit of 4096 MB (the site's default for a task: its launch gave no "
            "`--mem`) and was killed; ask for more with `launch --mem MB` (this workspace allows up to 8192 MB "
            "per task, kernel.json policy.max_mem_mb), or use less memory, smaller batches or fewer workers",
        ),
        (
            8192,
            4096,
            "the task went over its memory limit of 8192 MB (its launch asked for it: `launch --mem`) and was "
            "killed; that is already as much as this workspace allows a task (8192 MB, kernel.json "
            "policy.max_mem_mb): use less memory, smaller batches or fewer workers",
        ),
    ],
)
def test_an_out_of_memory_hint_names_the_limit_where_it_came_from_and_how_to_ask_for_more(
    tmp_path: Path, asked: int | None, default: int, hint: str
) -> None:
    """The old hint said "use less memory" with no way to ask for more; the limit is the launch's own when it
    asked, else the site's default, and more is offered only up to the workspace's max_mem_mb."""
    jobscript.write_exit(tmp_path, ExitRecord(137, "out_of_memory", signal="SIGKILL"))
    job = JobRow(
        "w-1", 3, "train", 0, 1, 0, "x", 10, 0, (), "", 0, "OUT_OF_MEMORY", exit_code=137, mem_mb=asked
    )
    files = gather.TaskFiles(hint=gather.end_hint(tmp_path, lambda _: None))
    got = gather.task_result(job, tmp_path, 1.0, files, memory=(default, 8192))
    assert (got.state, got.hint) == ("OUT_OF_MEMORY", hint)


def test_the_artifacts_of_a_stopped_task_are_marked_partial_and_no_others() -> None:
    from channel.lifecycle import STOPPED_TASK_STATES, TERMINAL_TASK_STATES
    from channel.messages import Artifact
    from kernel.service.gather import TaskFiles, task_result

    art = Artifact(path="ckpt.pt", delivered="results/1/a/ckpt.pt", size=1, sha256="ab" * 32)
    assert {
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "CANCELLED",
        "NODE_FAIL",
        "PREEMPTED",
        "VANISHED",
    } == STOPPED_TASK_STATES
    for state in sorted(TERMINAL_TASK_STATES):
        job = JobRow("w-1", 1, "a", 0, 1, 0, "x", 10, 0, ("ckpt.pt",), "", 0, state)
        [shown] = task_result(job, Path("/nonexistent"), 1.0, TaskFiles(artifacts=(art,))).artifacts
        assert shown.partial is (state in STOPPED_TASK_STATES), state
