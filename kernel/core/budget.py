"""A workspace's balance and its units, pure and exact.

Budgets are stored as integers: launches, sleeps, and GPU time in GPU-seconds (1 GPU-hour = 3600), so charges
and refunds never drift. Floats appear only in messages (`to_message`) and operators' input (`gpu_seconds`).
Every change of a balance (reserve, release, refund, grant) is decided by `kernel.core.ledger`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from channel.messages import Budget

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
