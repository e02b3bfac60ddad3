"""What a task's Slurm record means for the agent: its TaskState, a hint, and whether to keep waiting.

The wrapper's `exit-code` file is the ground truth for a job that ran to its end. Slurm's state, exit status and
signal are read together (never the state alone) for the jobs that died without writing it: killed for memory,
at the walltime, with their node, by preemption, by `scancel`. Anything unrecognized, missing or unanswered is
never taken for success, and a query that failed is "unknown": it changes nothing, so a controller that is down
for a while never turns running jobs into failures.

Pending reasons are split into healthy waits and reasons that never clear; the latter wake the sleep with the
reason instead of leaving it parked forever. The poll interval adapts: fast right after a change, slower while
nothing moves, and backing off while the controller does not answer.
"""

from __future__ import annotations

from typing import Final, Literal

from msgspec import Struct

from channel.messages import TaskState
from kernel.backends.slurm.query import SacctResult, SacctRow, SqueueResult, SqueueRow, TaskKey

# Slurm records an OOM kill as signal 125 on some sites (`ExitCode` 0:125) instead of state OUT_OF_MEMORY.
OOM_SIGNAL: Final = 125

WAITING_STATES: Final = frozenset(
    {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
)
RUNNING_STATES: Final = frozenset(
    {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "SUSPENDED", "STOPPED"}
)
ENDED_STATES: Final = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "BOOT_FAIL",
        "PREEMPTED",
        "REVOKED",
    }
)

# Pending reasons that no amount of waiting clears: the job needs a person (or a different request).
NEVER_CLEARS: Final = frozenset(
    {
        "DependencyNeverSatisfied",
        "PartitionDown",
        "PartitionInactive",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "PartitionConfig",
        "QOSJobLimit",
        "AssocJobLimit",
        "AccountNotAllowed",
        "QOSNotAllowed",
        "InvalidAccount",
        "InvalidQOS",
        "BadConstraints",
        "FrontEndDown",
        "JobHeldAdmin",
        "JobHeldUser",
        "launch failed requeued held",
        "SystemFailure",
    }
)
# Reasons that clear by themselves when nodes return; stuck only once they have lasted `NODE_WAIT_LIMIT_S`.
NODE_REASONS: Final = ("ReqNodeNotAvail", "NodeDown", "Nodes_required_for_job_are_DOWN")
NODE_WAIT_LIMIT_S: Final = 600.0

Hint = str | None
VANISHED_HINT: Final = "left the queue without writing its exit file, and Slurm has no record of how it ended"


class Classification(Struct, frozen=True):
    """`terminal` False: the task is still PENDING or RUNNING as far as Slurm is concerned."""

    state: TaskState
    terminal: bool
    hint: Hint = None
    recognized: bool = True


class Resolution(Struct, frozen=True):
    """The decision for one tracked task after a poll.

    `wait`: nothing final yet (`state` says PENDING or RUNNING when known, None when the query was unknown).
    `ask_accounting`: the task left the queue without an exit file: run `sacct` for it (batched).
    `done`: final, with `state` and `hint` for the wake.
    `stuck`: still pending for a reason that never clears: wake the sleep with `hint`.
    """

    action: Literal["wait", "ask_accounting", "done", "stuck"]
    state: TaskState | None = None
    hint: Hint = None
    exit_code: int | None = None
    signal: int | None = None


def classify_state(
    state: str,
    exit_status: int | None = None,
    signal: int | None = None,
    *,
    cancelled_by: int | None = None,
    our_uid: int | None = None,
    cancelled_by_kernel: bool = False,
    requeues: bool = False,
) -> Classification:
    """One Slurm record (state, exit status, signal) as our TaskState and a hint.

    `requeues`: the job will be requeued after preemption (site PreemptMode=REQUEUE and a requeueable job), so
    PREEMPTED is a wait, not an end. `cancelled_by_kernel`: the kernel itself asked for the cancel.
    """
    base = state.strip().upper().split(" ", 1)[0].rstrip("+")
    if base in WAITING_STATES:
        return Classification("PENDING", terminal=False)
    if base in RUNNING_STATES:
        return Classification("RUNNING", terminal=False)
    if base not in ENDED_STATES:
        return Classification(
            "VANISHED",
            terminal=True,
            hint=f"Slurm reported the state {state.strip()!r}, which the kernel does not know; it is not success",
            recognized=False,
        )
    if signal == OOM_SIGNAL or base == "OUT_OF_MEMORY":
        return Classification("OUT_OF_MEMORY", terminal=True)
    if base in ("TIMEOUT", "DEADLINE"):
        return Classification(
            "TIMEOUT", terminal=True, hint=None if base == "TIMEOUT" else "reached the scheduler's deadline"
        )
    if base in ("NODE_FAIL", "BOOT_FAIL"):
        return Classification(
            "NODE_FAIL", terminal=True, hint=None if base == "NODE_FAIL" else "the node failed to boot"
        )
    if base == "PREEMPTED":
        if requeues:
            return Classification("PENDING", terminal=False, hint="preempted; Slurm requeues it")
        return Classification("PREEMPTED", terminal=True)
    if base == "REVOKED":
        return Classification(
            "VANISHED", terminal=True, hint="revoked by the federation (it ran elsewhere or nowhere)"
        )
    if base == "CANCELLED":
        return Classification(
            "CANCELLED", terminal=True, hint=_cancel_hint(cancelled_by, our_uid, cancelled_by_kernel)
        )
    if base == "COMPLETED" and exit_status == 0 and not signal:
        return Classification("COMPLETED", terminal=True)
    # FAILED, or COMPLETED with a nonzero status or a signal: never success.
    hint = f"killed by signal {signal}" if signal else None
    return Classification("FAILED", terminal=True, hint=hint)


def _cancel_hint(cancelled_by: int | None, our_uid: int | None, by_kernel: bool) -> Hint:
    if by_kernel:
        return None
    if cancelled_by is None:
        return "cancelled by the scheduler, not through the kernel"
    if our_uid is not None and cancelled_by == our_uid:
        return f"cancelled with scancel outside the kernel (uid {cancelled_by})"
    return f"cancelled by the scheduler or an administrator (uid {cancelled_by}), not by you"


def classify_exit_file(code: int, scheduler: Classification | None = None) -> Classification:
    """The wrapper's `exit-code` (ground truth), refined by Slurm's view when Slurm explains a failure."""
    if code == 0:
        return Classification("COMPLETED", terminal=True)
    if (
        scheduler is not None
        and scheduler.terminal
        and scheduler.state in ("TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")
    ):
        return scheduler
    hint = f"killed by signal {code - 128}" if 128 < code < 160 else None
    return Classification("FAILED", terminal=True, hint=hint)


def pending_verdict(reason: str, pending_for_s: float) -> Literal["healthy", "stuck"]:
    """Whether a PENDING task's reason is a normal wait or one that never clears.

    Reasons like Priority, Resources, BeginTime, Dependency or any `*Max*PerUser`/`*Grp*` limit are waits for
    something that will come; unknown reasons are treated as waits too (they are not failures).
    """
    r = reason.strip()
    name = r.split(",", 1)[0].strip()
    if name in NEVER_CLEARS or r in NEVER_CLEARS:
        return "stuck"
    if name.startswith(NODE_REASONS) and pending_for_s >= NODE_WAIT_LIMIT_S:
        return "stuck"
    return "healthy"


def resolve_task(
    key: TaskKey,
    *,
    exit_code: int | None,
    queue: SqueueResult | None,
    accounting: SacctResult | None = None,
    pending_for_s: float = 0.0,
    our_uid: int | None = None,
    cancelled_by_kernel: bool = False,
    requeues: bool = False,
) -> Resolution:
    """Decide one tracked task from its exit file (None = absent), the last squeue, and sacct once it was asked.

    Read the exit file AFTER the squeue answer arrived: a job that ends in between is then seen with its file.
    `accounting` None means sacct was not asked yet; the caller asks it (batched) for every `ask_accounting`
    task and calls again with the answer, whatever its status.
    """
    row: SqueueRow | None = queue.entries.get(key) if queue is not None and queue.known else None
    acct: SacctRow | None = accounting.entries.get(key) if accounting is not None else None
    if exit_code is not None:
        seen = _from_acct(acct, our_uid, cancelled_by_kernel, requeues) if acct else None
        if seen is None and row is not None:
            seen = _from_row(row, cancelled_by_kernel, requeues)
        c = classify_exit_file(exit_code, seen)
        return Resolution("done", c.state, c.hint, exit_code=exit_code)
    if acct is not None:
        c = _from_acct(acct, our_uid, cancelled_by_kernel, requeues)
        if c.terminal:
            return Resolution("done", c.state, c.hint, exit_code=acct.exit_status, signal=acct.signal)
        return Resolution("wait", c.state, c.hint)
    if queue is None or not queue.known:
        return Resolution("wait")
    if row is None:
        # Left the queue without an exit file.
        if accounting is None:
            return Resolution("ask_accounting")
        if accounting.status == "unknown":
            return Resolution("wait")
        return Resolution("done", "VANISHED", VANISHED_HINT)
    c = _from_row(row, cancelled_by_kernel, requeues)
    if not c.recognized:
        return Resolution("wait")  # listed in the queue, so it exists: an unknown state there is not an end
    if not c.terminal:
        if c.state == "PENDING" and pending_verdict(row.reason, pending_for_s) == "stuck":
            return Resolution(
                "stuck", "PENDING", f"pending with the reason {row.reason!r}, which does not clear"
            )
        return Resolution("wait", c.state, c.hint)
    needs_accounting = c.state == "COMPLETED" or (c.state == "CANCELLED" and not cancelled_by_kernel)
    if needs_accounting and accounting is None:
        # COMPLETED without an exit file contradicts the wrapper, and squeue does not say who cancelled:
        # accounting has the exit status and the uid, where it exists.
        return Resolution("ask_accounting", c.state)
    if c.state == "COMPLETED":
        return Resolution("done", "VANISHED", "Slurm says COMPLETED but the job wrote no exit file")
    if c.state == "CANCELLED" and not cancelled_by_kernel:
        return Resolution("done", "CANCELLED", "cancelled outside the kernel (by scancel or the scheduler)")
    return Resolution("done", c.state, c.hint)


def _from_row(row: SqueueRow, by_kernel: bool, requeues: bool) -> Classification:
    # squeue has no exit status; Slurm only says COMPLETED for status 0 without a signal.
    status = 0 if row.state == "COMPLETED" else None
    return classify_state(row.state, status, None, cancelled_by_kernel=by_kernel, requeues=requeues)


def _from_acct(acct: SacctRow, our_uid: int | None, by_kernel: bool, requeues: bool) -> Classification:
    return classify_state(
        acct.state,
        acct.exit_status,
        acct.signal,
        cancelled_by=acct.cancelled_by,
        our_uid=our_uid,
        cancelled_by_kernel=by_kernel,
        requeues=requeues,
    )


def poll_interval(
    since_change_s: float, failures: int = 0, *, floor_s: float = 2.0, ceiling_s: float = 60.0
) -> float:
    """Seconds until the next batched squeue.

    Exit files (watched on the filesystem) report normal ends at once, so squeue only has to catch jobs that die
    without one: poll at `floor_s` right after a change, then slow down linearly (a tenth of the quiet time) up to
    `ceiling_s`; after `failures` consecutive failed queries back off exponentially, so a struggling controller
    is not hammered.
    """
    if floor_s <= 0 or ceiling_s < floor_s:
        raise ValueError(f"poll interval bounds must satisfy 0 < floor ({floor_s}) <= ceiling ({ceiling_s})")
    if failures > 0:
        return min(ceiling_s, floor_s * 2.0 ** min(failures, 16))
    return min(ceiling_s, max(floor_s, since_change_s / 10.0))
