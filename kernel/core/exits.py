"""Exit kind -> task state: the one table that says what a task's `exit-code` record means (pure).

Every finished task has exactly one exit record (`kernel.backends.jobscript.ExitRecord`), written by the wrapper
(`exited`, `signaled`, `timeout`, `terminated`, `empty_command`, `materialise_failed`, `wrapper_error`,
`environment_failed`, `out_of_memory`, `disk_full`, `disk_limit`) or, for
a task whose wrapper left none, by its backend (`lost`, `cancelled`; Slurm: `out_of_memory`, `failed`,
`node_fail`, `preempted`, `vanished`, `stuck`, `submit_failed`). `KINDS` maps each kind to the lifecycle event
the executor applies, the TaskState the wake shows, which of the record's exit code and signal are kept, and the
hint; a kind not in the table (a newer wrapper, a corrupt record) is read as a wrapper failure, never as success.
A unit test checks that every kind a wrapper or backend writes has its row here.

A scheduler may know why a task ended where its wrapper could not see it (Slurm's own state: the walltime, the
memory limit, a node failure, a preemption). `outcome(..., scheduler=STATE)` then applies the row of that end
(`SCHEDULER_KINDS`): to a SIGTERM the wrapper recorded (`terminated`) for any of them, and to a failure for the
first three (a preemption does not make a command fail). Each backend's `outcome_of`
(kernel.backends.base.Backend) is this function on the task's recorded exit, so there is one mapping.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from channel.lifecycle import TaskEvent
from channel.messages import TaskState

# What a task's state means for the agent, where channel.render's generic hints do not say enough.
HINT_FAILED: Final = "the command exited with a non-zero status; its stderr usually says why"
HINT_SIGNALED: Final = "the command was killed by {signal}"
HINT_EMPTY: Final = "the command was empty; nothing ran"
HINT_MATERIALISE: Final = (
    "the snapshot could not be written out on the node before the command started; this was not your "
    "command's fault, you may relaunch it"
)
HINT_WRAPPER: Final = (
    "the job wrapper failed around your command (the jail could not start?); see the stderr tail"
)
HINT_ENVIRONMENT: Final = (
    "the locked environment (uv.lock) could not be installed on the node before the command started; the "
    "stderr tail has uv's message; your command did not run"
)
# Where the kernel knows neither the task's limit nor the workspace's ceiling (`oom_hint` says both).
HINT_OOM: Final = (
    "the task went over its memory limit and was killed (`env` shows the limit); ask for more with "
    "`launch --mem MB` (up to kernel.json policy.max_mem_mb), or use less memory, smaller batches or fewer workers"
)


# The hints that send the reader to the task's stderr, and what each says instead where its stderr is empty
# (`output_hint`): a hint never points at output that is not there.
HINT_FAILED_NO_STDERR: Final = "the command exited with a non-zero status and wrote nothing to stderr; its stdout's last lines may say why"
HINT_FAILED_SILENT: Final = "the command exited with a non-zero status and printed nothing"
HINT_WRAPPER_SILENT: Final = (
    "the job wrapper failed around your command and left no message; this was not your command's fault: "
    "relaunch it, and tell the operator if it happens again"
)
HINT_ENVIRONMENT_SILENT: Final = (
    "the locked environment (uv.lock) could not be installed on the node before the command started, and uv left "
    "no message; your command did not run"
)


def output_hint(hint: str | None, stdout_tail: str, stderr_tail: str) -> str | None:
    """`hint` made true of what the task printed: a hint that sends the reader to its stderr is replaced by
    what is true where the stderr is empty (or only blank lines)."""
    if stderr_tail.strip():
        return hint
    if hint == HINT_FAILED:
        return HINT_FAILED_NO_STDERR if stdout_tail.strip() else HINT_FAILED_SILENT
    if hint == HINT_WRAPPER:
        return HINT_WRAPPER_SILENT
    if hint == HINT_ENVIRONMENT:
        return HINT_ENVIRONMENT_SILENT
    return hint


def eval_oom_hint(limit_mb: int | None) -> str:
    """The hint of a submit's evaluation run killed for its memory: a submit cannot ask for more (`--mem` is a
    launch's)."""
    had = f" of {limit_mb} MB" if limit_mb else ""
    return (
        f"the evaluation run went over its memory limit{had} and was killed; a submit cannot ask for more memory "
        "(`--mem` is a launch's): the candidate must use less, or ask the operator"
    )


def eval_timeout_hint(minutes: int) -> str:
    """The hint of a submit's evaluation run stopped at its walltime: no launch declared it, the submit's
    `eval_minutes` (else the contract's) did."""
    return (
        f"stopped for running past its walltime of {minutes} minutes (the submit's `eval_minutes`, else the "
        "contract's) once the backend enforced it, which can be later (its elapsed time says when); a submit can "
        "ask for more with `eval_minutes` (`submit --minutes`, up to kernel.json policy.max_minutes), or the "
        "evaluation must be made faster"
    )


def oom_hint(limit_mb: int | None, asked_mb: int | None, max_mem_mb: int) -> str:
    """The hint of a task killed for its memory: the limit it had (`limit_mb`; None where the kernel does not know
    it), whether its launch asked for it (`asked_mb`, `launch --mem`) or had the site's default, and how to get
    more: `--mem` up to the workspace's `max_mem_mb`, unless the task already had that much."""
    had = f" of {limit_mb} MB" if limit_mb else ""
    source = (
        " (its launch asked for it: `launch --mem`)"
        if asked_mb is not None
        else " (the site's default for a task: its launch gave no `--mem`)"
    )
    smaller = "use less memory, smaller batches or fewer workers"
    if limit_mb is not None and limit_mb >= max_mem_mb:
        return (
            f"the task went over its memory limit{had}{source} and was killed; that is already as much as this "
            f"workspace allows a task ({max_mem_mb} MB, kernel.json policy.max_mem_mb): {smaller}"
        )
    return (
        f"the task went over its memory limit{had}{source} and was killed; ask for more with `launch --mem MB` "
        f"(this workspace allows up to {max_mem_mb} MB per task, kernel.json policy.max_mem_mb), or {smaller}"
    )


# What follows the record's own detail (which says what happened, with the amounts) in the hint of a disk end.
AFTER_DISK_FULL: Final = "the output shown may be cut short; relaunch once the operator has freed space"
AFTER_DISK_LIMIT: Final = (
    "keep what the job writes in its tree, home and work directories under the limit (delete what it no longer "
    "needs while it runs) and its directories readable: the limit is checked by reading them"
)
HINT_DISK_FULL: Final = (
    "the disk of the kernel's run directory was full, so this task's output or result could not be stored; "
    + AFTER_DISK_FULL
)
HINT_DISK_LIMIT: Final = (
    "the job put more on disk in its tree, home and work directories than the per-task disk limit allows and "
    "was stopped; " + AFTER_DISK_LIMIT
)
# What follows the record's detail ("resubmission failed: ...") for a task the kernel could not submit again.
AFTER_SUBMIT_FAILED: Final = "your command did not run; relaunch it"
HINT_SUBMIT_FAILED: Final = (
    "the kernel could not submit this task again after its restart (the scheduler refused it); "
    + AFTER_SUBMIT_FAILED
)
HINT_LOST: Final = "the job ended without leaving a result (its wrapper was killed); relaunch it"
HINT_CANCELLED_EARLY: Final = "cancelled before it started"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A task's end as the lifecycle and the wake see it."""

    event: TaskEvent
    state: TaskState
    exit_code: int | None
    signal: int | None
    hint: str | None


@dataclass(frozen=True, slots=True)
class End:
    """One row of the table: an exit kind's event, state, what of the record is kept, and its hint."""

    event: TaskEvent
    state: TaskState
    keep_code: bool
    keep_signal: bool
    hint: str | None
    # Where set, the record's own `detail` (it names the limit and the amount), then this, is the hint.
    after_detail: str | None = None


_F, _C, _L = TaskEvent.FINISH, TaskEvent.CANCEL, TaskEvent.LOSE

# kind -> End. `exited` with code 0 is the one success (`COMPLETED`); every other row is an end without one.
KINDS: Final[Mapping[str, End]] = {
    # written by the wrapper
    "exited": End(_F, "FAILED", True, False, HINT_FAILED),
    "signaled": End(_F, "FAILED", True, True, HINT_SIGNALED),
    "timeout": End(_F, "TIMEOUT", True, True, None),
    "terminated": End(_C, "CANCELLED", True, True, None),
    "empty_command": End(_F, "FAILED", True, False, HINT_EMPTY),
    "materialise_failed": End(_F, "FAILED", True, False, HINT_MATERIALISE),
    "wrapper_error": End(_F, "FAILED", True, True, HINT_WRAPPER),
    "environment_failed": End(_F, "FAILED", True, False, HINT_ENVIRONMENT),
    # written by the wrapper when its task's memory cgroup saw an OOM kill (the local backend's limits), and by
    # the Slurm backend from Slurm's own account (whose hint in slurm-state.json comes first)
    "out_of_memory": End(_F, "OUT_OF_MEMORY", True, True, HINT_OOM),
    # written by the wrapper (or, when even that could not be written, held by the local backend): the run
    # directory's disk was full; and the job's tree past the local backend's `tree_mb`
    "disk_full": End(_F, "FAILED", True, False, HINT_DISK_FULL, AFTER_DISK_FULL),
    "disk_limit": End(_F, "FAILED", True, False, HINT_DISK_LIMIT, AFTER_DISK_LIMIT),
    # written by a backend for a task whose wrapper left no record
    "lost": End(_L, "VANISHED", False, True, HINT_LOST),
    "cancelled": End(_C, "CANCELLED", False, False, HINT_CANCELLED_EARLY),
    # written by the Slurm backend from Slurm's own account (its hint is in slurm-state.json)
    "failed": End(_F, "FAILED", True, True, None),
    "node_fail": End(_L, "NODE_FAIL", False, True, None),
    "preempted": End(_L, "PREEMPTED", False, True, None),
    "vanished": End(_L, "VANISHED", False, True, None),
    # cancelled by the kernel: its pending reason never clears
    "stuck": End(_C, "CANCELLED", False, True, None),
    # a launch resubmitted after a restart was refused
    "submit_failed": End(_F, "FAILED", True, True, HINT_SUBMIT_FAILED, AFTER_SUBMIT_FAILED),
}
_UNKNOWN: Final = KINDS["wrapper_error"]

# A scheduler's state that explains an end -> the kind whose row then applies.
SCHEDULER_KINDS: Final[Mapping[TaskState, str]] = {
    "TIMEOUT": "timeout",
    "OUT_OF_MEMORY": "out_of_memory",
    "NODE_FAIL": "node_fail",
    "PREEMPTED": "preempted",
}
# Those of them that explain a failure too (the command was killed because of them).
_EXPLAIN_FAILURE: Final = frozenset({"TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"})


def signum(name: str | None) -> int | None:
    """The number of a signal named like `SIGKILL`, or None for no or an unknown name."""
    if not name:
        return None
    try:
        return int(signal.Signals[name])
    except KeyError:
        return None


def outcome(
    kind: str,
    code: int | None,
    signal_name: str | None,
    scheduler: TaskState | None = None,
    detail: str | None = None,
) -> Outcome:
    """What an exit record (`kind`, exit `code`, `signal_name`, `detail`) means, from `KINDS`; `scheduler` is
    the state the scheduler gave the task, where it has one (see the module's note)."""
    if kind == "exited" and code == 0:
        return Outcome(TaskEvent.FINISH, "COMPLETED", 0, None, None)
    end = KINDS.get(kind, _UNKNOWN)
    over = None if scheduler is None else SCHEDULER_KINDS.get(scheduler)
    if over is not None and (
        kind == "terminated" or (end.state == "FAILED" and scheduler in _EXPLAIN_FAILURE)
    ):
        end = KINDS[over]
    hint = end.hint
    if end.after_detail is not None and detail:
        hint = f"{detail}; {end.after_detail}"
    if hint == HINT_SIGNALED:
        hint = hint.format(signal=signal_name or "a signal")
    return Outcome(
        end.event,
        end.state,
        code if end.keep_code else None,
        signum(signal_name) if end.keep_signal else None,
        hint,
    )


# The last import a Python traceback says failed (job-written text: only a plain dotted name is taken from it).
_NO_MODULE: Final = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z_][A-Za-z0-9_.]{0,63})'")


def import_hint(stderr_tail: str, environment_mode: str) -> str | None:
    """The hint of a command that failed on a missing import (its stderr's last `ModuleNotFoundError`), for a
    kernel whose `environment.mode` is `environment_mode`; None when its stderr shows none."""
    found = _NO_MODULE.findall(stderr_tail)
    if not found:
        return None
    module = found[-1]
    top = module.split(".")[0]
    own = (
        "if it is a module of your own, it must be in the snapshot (committed, or untracked and not ignored) "
        "and importable from the job's working directory"
    )
    if environment_mode == "uv":
        return (
            f"the command could not import `{module}` (ModuleNotFoundError): no package of the job's environment "
            f"provides it. If it is a package, add it with `uv add {top}` (its package name may differ from the "
            "import name; `uv init --bare` first where the workspace has no pyproject.toml), commit "
            "pyproject.toml and uv.lock and sleep again (jobs have no network to install it; `env` lists "
            f"what they get); {own}"
        )
    return (
        f"the command could not import `{module}` (ModuleNotFoundError): jobs run the system's python3 with only "
        "its own packages, and this kernel does not build environments from uv.lock (ask the operator for a "
        f"package); {own}"
    )


# The shell's "not found" line for a command (dash: `sh: 1: NAME: not found`; bash: `bash: line 1: NAME: command
# not found`);
# job-written text, so only a plain command name is taken from it.
_NOT_FOUND: Final = re.compile(
    r"(?m)^(?:\S+: (?:(?:line )?\d+: )?)?([A-Za-z0-9_.+-]{1,64}): (?:command )?not found$"
)


def not_found_hint(exit_code: int | None, stderr_tail: str) -> str | None:
    """The hint of a command the shell could not find (exit 127 and its "not found" line), None otherwise."""
    if exit_code != 127:
        return None
    found = _NOT_FOUND.findall(stderr_tail)
    if not found:
        return None
    name = found[-1]
    also = (
        " (its `interpreter:` line names the Python they run)" if name.startswith(("python", "pip")) else ""
    )
    return (
        f"the shell found no command `{name}` (exit 127): jobs get the system's commands and, with a uv.lock, "
        f"those of its locked environment, not the ones of your own shell; `syscall env` says what they get{also}, "
        "and a script of your own must be in the snapshot (committed, or untracked and not ignored)"
    )
