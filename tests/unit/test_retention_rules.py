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


def sized(*spec: tuple[str, int]) -> list[SleepAge]:
    """(state, run-directory bytes) for seq 1, 2, ...; every sleep ended now."""
    return [SleepAge(i + 1, state, NOW, run_bytes=b) for i, (state, b) in enumerate(spec)]


@pytest.mark.parametrize(
    ("spec", "keep_bytes", "gone"),
    [
        # newest first: 6 (1) + 4 (4) = 5 fits in 6; 3 brings it to 8: 3 and everything older go
        (
            (("woken", 9), ("woken", 1), ("woken", 3), ("woken", 4), ("executing", 0), ("woken", 1)),
            6,
            [1, 2, 3],
        ),
        # a sleep in flight counts first and never goes: 5 (executing, 5) + 4 (2) = 7 > 6, 4 kept as the newest
        ((("woken", 1), ("woken", 1), ("woken", 1), ("woken", 2), ("executing", 5)), 6, [1, 2, 3]),
        # the newest woken sleep stays even alone past the cap
        ((("woken", 1), ("woken", 100)), 6, [1]),
        ((("woken", 1), ("woken", 1)), 0, []),  # no cap
    ],
)
def test_the_size_cap_keeps_the_newest_woken_sleeps_that_fit(
    spec: tuple[tuple[str, int], ...], keep_bytes: int, gone: list[int]
) -> None:
    assert to_prune(sized(*spec), keep_sleeps=0, keep_days=0, now=NOW, keep_bytes=keep_bytes) == gone


def test_the_size_cap_prunes_what_the_count_and_the_age_would_keep() -> None:
    s = sized(("woken", 5), ("woken", 5), ("woken", 5))
    assert to_prune(s, keep_sleeps=10, keep_days=100, now=NOW, keep_bytes=12) == [1]
