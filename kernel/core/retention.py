"""Retention: which woken sleeps' evidence may go (pure; kernel.io.retention does the removing).

A workspace keeps its newest `keep_sleeps` woken sleeps and every sleep woken within `keep_days`; with both
set a sleep is kept when either says so, and with neither nothing is pruned. Only woken (or rejected) sleeps
are ever candidates: a sleep in flight still needs its run directory, the ground truth its wake is gathered
from, so no setting can take it away.
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


def to_prune(sleeps: Sequence[SleepAge], *, keep_sleeps: int, keep_days: float, now: datetime) -> list[int]:
    """The seqs of `sleeps` (one workspace's) whose run directories, results and bulky records may go."""
    if keep_sleeps <= 0 and keep_days <= 0:
        return []
    done = sorted((s for s in sleeps if s.state in DONE_STATES), key=lambda s: s.seq, reverse=True)
    kept_by_count = {s.seq for s in done[:keep_sleeps]} if keep_sleeps > 0 else set()
    cutoff = now - timedelta(days=keep_days) if keep_days > 0 else None
    out = []
    for s in done:
        if s.seq in kept_by_count or (cutoff is not None and s.ended_at > cutoff):
            continue
        out.append(s.seq)
    return sorted(out)
