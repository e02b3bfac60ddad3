"""kernel.core.exits: the one exit kind -> state table covers every kind a wrapper or backend writes."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from channel.lifecycle import TaskEvent, next_task_state
from channel.messages import TaskState
from kernel.backends import jobscript
from kernel.backends.local import LocalBackend
from kernel.backends.slurm import backend as slurm
from kernel.core import exits
from kernel.node import wrapper as W


def _kinds(module: object) -> set[str]:
    return {v for k, v in vars(module).items() if k.startswith("KIND_") and isinstance(v, str)}


def test_every_written_kind_has_a_row() -> None:
    written = _kinds(W) | _kinds(jobscript) | _kinds(slurm) | {k for _, k in slurm.KIND_OF_STATE.values()}
    missing = written - set(exits.KINDS)
    assert not missing, f"exit kinds without a row in kernel.core.exits.KINDS: {sorted(missing)}"


def test_only_exit_zero_is_success() -> None:
    assert exits.outcome("exited", 0, None).state == "COMPLETED"
    for kind in exits.KINDS:
        assert exits.outcome(kind, 1, None).state != "COMPLETED", kind
    unknown = exits.outcome("from-a-newer-wrapper", 0, "SIGKILL")
    assert (unknown.event, unknown.state, unknown.hint) == (TaskEvent.FINISH, "FAILED", exits.HINT_WRAPPER)


def test_signal_names_become_numbers_only_where_kept() -> None:
    assert exits.outcome("signaled", 137, "SIGKILL").signal == 9
    assert exits.outcome("signaled", 137, "SIGKILL").hint == "the command was killed by SIGKILL"
    assert exits.outcome("exited", 3, "SIGKILL").signal is None
    assert exits.outcome("lost", None, "SIGNOPE").signal is None


def _record(tmp: Path, name: str, rec: jobscript.ExitRecord) -> Path:
    tdir = tmp / name
    tdir.mkdir()
    jobscript.write_exit(tdir, rec)
    return tdir


def test_every_backend_reads_an_exit_record_through_the_one_table(tmp_path: Path) -> None:
    """`Backend.outcome_of`: the local and the Slurm backend give what kernel.core.exits.outcome gives for every
    kind (the Slurm backend adds only what Slurm itself recorded, and nothing is recorded here)."""

    async def main() -> None:
        local = LocalBackend()
        async with anyio.create_task_group() as tg:
            await tg.start(local.run)  # as the service runs it (its streams close when it stops)
            check(local)
            tg.cancel_scope.cancel()

    def check(local: LocalBackend) -> None:
        cases = [(kind, code) for kind in [*exits.KINDS, "from-a-newer-wrapper"] for code in (0, 1, 137)]
        for i, (kind, code) in enumerate(cases):
            tdir = _record(tmp_path, f"t{i}", jobscript.ExitRecord(code, kind, signal="SIGKILL"))
            want = exits.outcome(kind, code, "SIGKILL")
            assert local.outcome_of(tdir) == slurm.outcome_of(tdir) == want, (kind, code)
        empty = tmp_path / "running"
        empty.mkdir()
        assert local.outcome_of(empty) is None
        assert slurm.outcome_of(empty) is None

    anyio.run(main)


@pytest.mark.parametrize(
    ("kind", "code", "scheduler", "state"),
    [
        # a SIGTERM the wrapper saw: Slurm says why
        ("terminated", 143, "TIMEOUT", "TIMEOUT"),
        ("terminated", 143, "PREEMPTED", "PREEMPTED"),
        ("terminated", 143, "NODE_FAIL", "NODE_FAIL"),
        ("terminated", 143, "OUT_OF_MEMORY", "OUT_OF_MEMORY"),
        ("terminated", 143, "CANCELLED", "CANCELLED"),
        # a failure Slurm caused
        ("signaled", 137, "OUT_OF_MEMORY", "OUT_OF_MEMORY"),
        ("exited", 1, "TIMEOUT", "TIMEOUT"),
        ("exited", 1, "NODE_FAIL", "NODE_FAIL"),
        # a preemption does not make a command fail, and nothing overrides a success or the wrapper's own kinds
        ("signaled", 137, "PREEMPTED", "FAILED"),
        ("exited", 0, "OUT_OF_MEMORY", "COMPLETED"),
        ("timeout", 124, "CANCELLED", "TIMEOUT"),
        ("cancelled", 143, "TIMEOUT", "CANCELLED"),
        ("exited", 1, "FAILED", "FAILED"),
    ],
)
def test_the_scheduler_state_applies_the_row_of_its_end(
    tmp_path: Path, kind: str, code: int, scheduler: TaskState, state: str
) -> None:
    out = exits.outcome(kind, code, "SIGTERM", scheduler)
    assert out.state == state
    assert next_task_state("RUNNING", out.event, out.state) == state  # a move the lifecycle allows
    # the Slurm backend reads it the same way from the task's files once it recorded Slurm's state there
    tdir = _record(tmp_path, "t", jobscript.ExitRecord(code, kind, signal="SIGTERM"))
    slurm._write_json(tdir, slurm.STATE_FILE, slurm.TaskSlurmState("5", scheduler))
    assert slurm.outcome_of(tdir) == out


def test_a_disk_end_says_what_its_record_says() -> None:
    detail = (
        "the job's tree exceeded its 2048 MiB disk limit (its tree, home and work directories held 2050 MiB)"
    )
    out = exits.outcome("disk_limit", 119, None, detail=detail)
    assert (out.state, out.exit_code) == ("FAILED", 119)
    assert out.hint is not None
    assert out.hint == f"{detail}; {exits.AFTER_DISK_LIMIT}"
    assert exits.outcome("disk_full", 118, None).hint == exits.HINT_DISK_FULL
    # only the disk kinds take their record's detail as their hint
    assert exits.outcome("exited", 1, None, detail="anything").hint == exits.HINT_FAILED


def test_a_missing_import_is_named_with_the_fix_of_this_kernel() -> None:
    tb = (
        'Traceback (most recent call last):\n  File "train.py", line 1\n'
        "ModuleNotFoundError: No module named 'sklearn.linear_model'\n"
    )
    uv = exits.import_hint(tb, "uv")
    assert uv is not None
    assert "could not import `sklearn.linear_model`" in uv
    assert "`uv add sklearn`" in uv
    assert "package name may differ" in uv  # sklearn's is scikit-learn: the hint must not claim otherwise
    plain = exits.import_hint(tb, "none")
    assert plain is not None
    assert "uv add" not in plain
    assert "does not build environments from uv.lock" in plain
    assert exits.import_hint("ValueError: bad\n", "uv") is None
    # job-written text: only a plain dotted name is taken, never markup
    assert exits.import_hint("ModuleNotFoundError: No module named '`x`'", "uv") is None


def test_a_command_the_shell_did_not_find_is_named() -> None:
    dash = exits.not_found_hint(127, "sh: 1: python: not found\n")
    assert dash is not None
    assert "found no command `python` (exit 127)" in dash
    assert "`interpreter:` line" in dash  # a Python name: where to read which Python jobs run
    bash = exits.not_found_hint(127, "bash: line 1: nvcc: command not found\n")
    plain = exits.not_found_hint(127, "nvcc: command not found\n")
    assert plain is not None
    assert "`nvcc`" in plain
    assert "interpreter" not in plain
    assert bash is not None
    assert "`nvcc`" in bash
    assert exits.not_found_hint(1, "sh: 1: python: not found\n") is None  # not the shell's 127
    assert exits.not_found_hint(127, "Segmentation fault\n") is None
    # job-written text: only a plain command name is taken, never markup
    assert exits.not_found_hint(127, "sh: 1: `x`: not found\n") is None
