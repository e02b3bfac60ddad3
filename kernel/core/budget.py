"""Budget arithmetic, pure and exact.

Budgets are stored as integers: launches, sleeps, and GPU time in GPU-seconds (1 GPU-hour = 3600), so charges
and refunds never drift. Floats appear only in messages (`to_message`). A sleep costs one sleep and one launch per
launch whatever its array width; at acceptance it reserves `gpus * minutes * 60 * array` GPU-seconds per launch,
moved from `gpu_s` into `reserved_gpu_s`. When work ends, the reservation is released and what was not used is
refunded; a refusal costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from channel.decode import RequestError
from channel.messages import Budget, Launch

GPU_SECONDS_PER_HOUR: Final = 3600


@dataclass(frozen=True, slots=True)
class Balance:
    """What a workspace may still spend, and what running work holds."""

    launches: int
    sleeps: int
    gpu_s: int
    reserved_gpu_s: int = 0

    def __post_init__(self) -> None:
        if min(self.launches, self.sleeps, self.gpu_s, self.reserved_gpu_s) < 0:
            raise ValueError(f"a budget cannot go negative: {self}")

    def to_message(self) -> Budget:
        return Budget(
            launches=self.launches,
            sleeps=self.sleeps,
            gpu_hours=gpu_hours(self.gpu_s),
            reserved_gpu_hours=gpu_hours(self.reserved_gpu_s),
        )


def gpu_seconds(hours: float) -> int:
    """GPU-hours as given by an operator (e.g. 1.5) -> exact GPU-seconds, rounded to the nearest second."""
    if hours < 0:
        raise ValueError(f"GPU-hours cannot be negative: {hours}")
    return round(hours * GPU_SECONDS_PER_HOUR)


def gpu_hours(seconds: int) -> float:
    return round(seconds / GPU_SECONDS_PER_HOUR, 6)


def task_cost(launch: Launch) -> int:
    """GPU-seconds one task of `launch` reserves."""
    return launch.gpus * launch.minutes * 60


def launch_cost(launch: Launch) -> int:
    return task_cost(launch) * launch.array


def charge_sleep(balance: Balance, launches: tuple[Launch, ...]) -> Balance:
    """The balance after accepting a sleep with `launches`, or RequestError saying what is short."""
    if balance.sleeps < 1:
        raise RequestError("budget.sleeps", "this workspace has no sleeps left in its budget", None)
    if len(launches) > balance.launches:
        raise RequestError(
            "budget.launches",
            f"the sleep has {len(launches)} launches but only {balance.launches} are left in the budget",
            "$.launches",
        )
    cost = sum(launch_cost(x) for x in launches)
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


def release(balance: Balance, reserved: int, used: int) -> Balance:
    """Release a task's reservation of `reserved` GPU-seconds of which `used` were consumed; refund the rest."""
    if not 0 <= reserved <= balance.reserved_gpu_s:
        raise ValueError(f"cannot release {reserved} GPU-s; only {balance.reserved_gpu_s} are reserved")
    used = max(0, min(used, reserved))
    return replace(
        balance, gpu_s=balance.gpu_s + reserved - used, reserved_gpu_s=balance.reserved_gpu_s - reserved
    )


def refund_sleep(balance: Balance, launches: int, reserved: int) -> Balance:
    """Undo `charge_sleep` for a sleep refused after it was charged (nothing ran)."""
    if not 0 <= reserved <= balance.reserved_gpu_s:
        raise ValueError(f"cannot refund {reserved} GPU-s; only {balance.reserved_gpu_s} are reserved")
    return replace(
        balance,
        launches=balance.launches + launches,
        sleeps=balance.sleeps + 1,
        gpu_s=balance.gpu_s + reserved,
        reserved_gpu_s=balance.reserved_gpu_s - reserved,
    )
