"""Retention's choice of what may go (kernel.core.retention.to_prune): never a sleep in flight."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kernel.core.retention import SleepAge, to_prune

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)


def ages(*spec: tuple[str, float]) -> list[SleepAge]:
    """(state, days ago it ended) for seq 1, 2, ..."""
    return [SleepAge(i + 1, state, NOW - timedelta(days=d)) for i, (state, d) in enumerate(spec)]


OLD = ages(("woken", 30), ("rejected", 20), ("woken", 10), ("woken", 2), ("executing", 40), ("woken", 0.5))


@pytest.mark.parametrize(
    ("keep_sleeps", "keep_days", "gone"),
    [
        (0, 0, []),  # the default keeps everything
        (2, 0, [1, 2, 3]),  # the newest 2 done sleeps (6, 4) stay
        (0, 7, [1, 2, 3]),  # ended within a week: 4 and 6
        (0, 15, [1, 2]),
        (4, 7, [1]),  # kept when either keeps it
        (1, 100, []),
        (100, 0, []),
    ],
)
def test_what_goes(keep_sleeps: int, keep_days: float, gone: list[int]) -> None:
    assert to_prune(OLD, keep_sleeps=keep_sleeps, keep_days=keep_days, now=NOW) == gone


@pytest.mark.parametrize(
    "state", ["recorded", "validated", "snapshotted", "submitted", "executing", "gathered"]
)
def test_a_sleep_in_flight_never_goes_however_old(state: str) -> None:
    s = ages((state, 3650), ("woken", 1), ("woken", 0))
    assert 1 not in to_prune(s, keep_sleeps=1, keep_days=0.001, now=NOW)
