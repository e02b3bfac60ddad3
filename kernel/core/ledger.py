"""The ledger: the one place that decides budget amounts (pure).

What a sleep reserves, what a finished task releases, what a refused, cancelled or skipped thing refunds, and what
an operator grants are decided here and nowhere else (tests/unit/test_ledger.py scans the kernel for GPU-time
arithmetic and changed `Balance`s outside this module). Callers ask, then apply the answer in their own store
transaction, so a decision and the rows it is about commit together or not at all.

Amounts are exact integers (GPU time in GPU-seconds; `kernel.core.budget` holds the `Balance` and the unit
conversions). Conservation: every GPU-second taken from `gpu_s` is held in `reserved_gpu_s` until its task ends;
it then goes back to `gpu_s` except what the task used, which is capped at what it held. So for any sequence of
decisions, charged = used + refunded + still reserved, and no count goes below zero (`Balance` refuses it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from math import ceil

from channel.decode import RequestError
from channel.messages import Launch
from kernel.core.budget import Balance, gpu_hours
from kernel.core.records import JobRow

SECONDS_PER_MINUTE = 60


class Overdrawn(ValueError):
    """An operator's edit would leave `column` (launches, sleeps or gpu_s) below zero."""

    def __init__(self, column: str) -> None:
        super().__init__(f"the change would leave {column} below zero")
        self.column = column


@dataclass(frozen=True, slots=True)
class Settlement:
    """A finished task's release: the balance after it, the GPU-seconds it used (at most what it held), and
    what of its reservation did not become use (for the wake's `refunded_gpu_hours`)."""

    balance: Balance
    used_gpu_s: int
    refunded_gpu_s: int


# --- what things cost ---------------------------------------------------------------------------------------


def task_reservation(gpus: int, minutes: int) -> int:
    """GPU-seconds one task of `gpus` GPUs for `minutes` minutes reserves (its whole walltime)."""
    return gpus * minutes * SECONDS_PER_MINUTE


def launch_reservation(launch: Launch) -> int:
    """GPU-seconds a launch reserves: one task's reservation per array index."""
    return task_reservation(launch.gpus, launch.minutes) * launch.array


def measured_use(gpus: int, elapsed_s: float | None) -> int:
    """GPU-seconds a task used: its GPUs times its measured elapsed time, rounded up; nothing for a task that
    never ran (no elapsed time) or used no GPU."""
    return 0 if elapsed_s is None or gpus == 0 else ceil(gpus * max(0.0, elapsed_s))


# --- grants -------------------------------------------------------------------------------------------------


def opening(launches: int, sleeps: int, gpu_s: int) -> Balance:
    """A new workspace's balance: what the operator's defaults grant, nothing reserved."""
    return Balance(launches=launches, sleeps=sleeps, gpu_s=gpu_s)


def granted(
    base: Balance, *, launches: int | None = None, sleeps: int | None = None, gpu_s: int | None = None
) -> Balance:
    """`base` with the counts an operator grants set (None keeps the count); what running work holds stays."""
    return Balance(
        launches=base.launches if launches is None else launches,
        sleeps=base.sleeps if sleeps is None else sleeps,
        gpu_s=base.gpu_s if gpu_s is None else gpu_s,
        reserved_gpu_s=base.reserved_gpu_s,
    )


def edited(base: Balance, set_to: Mapping[str, int], add: Mapping[str, int]) -> Balance:
    """An operator's edit: counts set first, then signed additions (keys: launches, sleeps, gpu_s). Overdrawn
    when a count would go below zero; what running work holds is never edited."""
    values = {"launches": base.launches, "sleeps": base.sleeps, "gpu_s": base.gpu_s}
    for col, v in set_to.items():
        values[col] = v
    for col, v in add.items():
        values[col] += v
    for col, v in values.items():
        if v < 0:
            raise Overdrawn(col)
    return granted(base, **values)


# --- reserving ----------------------------------------------------------------------------------------------


def reserve_sleep(balance: Balance, launches: tuple[Launch, ...]) -> Balance:
    """The balance after accepting a sleep with `launches`, or RequestError saying what is short. A sleep costs
    one sleep and one launch per launch whatever its array width, and reserves every task's GPU time."""
    if balance.sleeps < 1:
        raise RequestError("budget.sleeps", "this workspace has no sleeps left in its budget", None)
    if len(launches) > balance.launches:
        raise RequestError(
            "budget.launches",
            f"the sleep has {len(launches)} launches but only {balance.launches} are left in the budget",
            "$.launches",
        )
    cost = sum(launch_reservation(x) for x in launches)
    if cost > balance.gpu_s:
        raise RequestError(
            "budget.gpu_hours",
            f"the launches reserve {gpu_hours(cost):g} GPU-hours (gpus x minutes/60 x array) but only "
            f"{gpu_hours(balance.gpu_s):g} are left",
            "$.launches",
        )
    return replace(
        balance,
        launches=balance.launches - len(launches),
        sleeps=balance.sleeps - 1,
        gpu_s=balance.gpu_s - cost,
        reserved_gpu_s=balance.reserved_gpu_s + cost,
    )


def reserve_eval(balance: Balance, jobs: Sequence[JobRow]) -> Balance:
    """Reserve a submit's evaluation runs' GPU time (released as measured, like a launch's); a submit costs no
    launch. RequestError when the GPU time left after the launches is short."""
    cost = sum(j.reserved_gpu_s for j in jobs)
    if cost > balance.gpu_s:
        raise RequestError(
            "budget.gpu_hours",
            f"the submit's {len(jobs)} evaluation runs reserve {gpu_hours(cost):g} GPU-hours but only "
            f"{gpu_hours(balance.gpu_s):g} are left after the launches",
            "$.submit",
        )
    return replace(balance, gpu_s=balance.gpu_s - cost, reserved_gpu_s=balance.reserved_gpu_s + cost)


# --- releasing and refunding --------------------------------------------------------------------------------


def _release(balance: Balance, held: int, used: int) -> Balance:
    """Give back `held` reserved GPU-seconds of which `used` (capped at `held`) were consumed."""
    if not 0 <= held <= balance.reserved_gpu_s:
        raise ValueError(f"cannot release {held} GPU-s; only {balance.reserved_gpu_s} are reserved")
    used = max(0, min(used, held))
    return replace(balance, gpu_s=balance.gpu_s + held - used, reserved_gpu_s=balance.reserved_gpu_s - held)


def settle_task(balance: Balance, job: JobRow, elapsed_s: float | None) -> Settlement:
    """A task that ended (or never ran) at its sleep's gather: what it holds is released, its measured use
    (capped at what it holds) is spent, the rest refunded. A task whose reservation was refunded earlier
    (cancelled before dispatch, a skipped evaluation run) holds nothing and used nothing."""
    used = min(measured_use(job.gpus, elapsed_s), job.reserved_gpu_s)
    return Settlement(
        balance=_release(balance, job.reserved_gpu_s, used),
        used_gpu_s=used,
        refunded_gpu_s=task_reservation(job.gpus, job.minutes) - used,
    )


def refund_unrun(balance: Balance, job: JobRow) -> Balance:
    """A task that will never run (cancelled before it was handed to a backend, or an evaluation run the kernel
    skipped): its whole reservation back."""
    return _release(balance, job.reserved_gpu_s, 0)


def refund_rejected_sleep(balance: Balance, launches: int, jobs: Sequence[JobRow]) -> Balance:
    """Undo `reserve_sleep` (and `reserve_eval`) for a sleep refused after it was charged (nothing ran): its
    sleep, its `launches` and every task's reservation back."""
    reserved = reserved_by(jobs)
    if not 0 <= reserved <= balance.reserved_gpu_s:
        raise ValueError(f"cannot refund {reserved} GPU-s; only {balance.reserved_gpu_s} are reserved")
    return replace(
        balance,
        launches=balance.launches + launches,
        sleeps=balance.sleeps + 1,
        gpu_s=balance.gpu_s + reserved,
        reserved_gpu_s=balance.reserved_gpu_s - reserved,
    )


def reserved_by(jobs: Sequence[JobRow]) -> int:
    """The GPU-seconds `jobs` hold reserved (what `refund_rejected_sleep` gives back of them)."""
    return sum(j.reserved_gpu_s for j in jobs)


def refund_sleep_count(balance: Balance) -> Balance:
    """A sleep that cost nothing after all (a submit found `unchanged` that is all its sleep carries): its
    sleep back. Its reservations are refunded by `refund_unrun`, one task at a time."""
    return replace(balance, sleeps=balance.sleeps + 1)
