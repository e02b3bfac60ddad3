"""Retention: which woken sleeps' evidence may go (pure; kernel.io.retention does the removing).

A workspace keeps its newest `keep_sleeps` woken sleeps and every sleep woken within `keep_days`; with both
set a sleep is kept when either says so, and with neither nothing is pruned. Only woken (or rejected) sleeps
are ever candidates: a sleep in flight still needs its run directory, the ground truth its wake is gathered
from, so no setting can take it away.

`keep_bytes` is a cap on the kernel's disk, over the others: counting the sleeps in flight first, then the woken
ones newest first, every woken sleep past the point where the run directories' total passes `keep_bytes` goes,
whatever the count and the age would keep, except the newest woken sleep (its wake was just delivered and names
its results).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

DONE_STATES = frozenset({"woken", "rejected"})


@dataclass(frozen=True, slots=True)
class SleepAge:
    seq: int
    state: str
    ended_at: datetime  # when it was woken (a rejected sleep: when it was made)
    run_bytes: int = 0  # what its run directory holds (known only where keep_bytes is set)


def to_prune(
    sleeps: Sequence[SleepAge], *, keep_sleeps: int, keep_days: float, now: datetime, keep_bytes: int = 0
) -> list[int]:
    """The seqs of `sleeps` (one workspace's) whose run directories, results and bulky records may go."""
    done = sorted((s for s in sleeps if s.state in DONE_STATES), key=lambda s: s.seq, reverse=True)
    out: set[int] = set()
    if keep_sleeps > 0 or keep_days > 0:
        kept_by_count = {s.seq for s in done[:keep_sleeps]} if keep_sleeps > 0 else set()
        cutoff = now - timedelta(days=keep_days) if keep_days > 0 else None
        out = {s.seq for s in done if s.seq not in kept_by_count and (cutoff is None or s.ended_at <= cutoff)}
    if keep_bytes > 0:
        total = sum(s.run_bytes for s in sleeps if s.state not in DONE_STATES)
        for i, s in enumerate(done):
            total += s.run_bytes
            if i > 0 and total > keep_bytes:
                out.add(s.seq)
    return sorted(out)
