"""The polled channels' looks: one `stat` of each `requests/` on threads of their own, in batches, fed to the
pure schedule (kernel.core.polling), which says which channels to list in full.

Invariants, and why they hold:
- A look only reads the attributes of `<workspace>/.syscall/requests` (`lstat`, no open, no read): whatever the
  agent put there (a symlink, a FIFO, a swapped directory) changes at most the stamp, which only decides whether
  the channel is listed, and the listing does every check (safefs). An agent that freezes its own stamp hides
  its own requests until the rescan, nobody else's.
- A hung filesystem holds one thread, not the polling: a batch still running `deadline` seconds after it began
  gives up the channel it is stuck on (that channel is looked at again only once its `stat` returns, and its
  workspace is marked, so its turn shows the hang in `status` as any channel I/O does) and hands the rest of its
  keys back. At most MAX_STUCK batches may be stuck at once; past that (a whole filesystem hung) no new batch
  starts until one returns, so threads never grow without bound.
- Only the event loop touches the schedule: a batch's thread fills its own lists and hands them over with
  `call_soon`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from anyio.lowlevel import EventLoopToken

from channel.paths import CHANNEL_DIR, ChannelPaths
from kernel.core.polling import DirStamp, PollSchedule
from kernel.io import log, metrics
from kernel.io.loopcall import call_soon

BATCH: Final = 512
MAX_RUNNING: Final = 4
MAX_STUCK: Final = 16


def stamp_of(workspace: str) -> DirStamp | None:
    """The stamp of the channel's `requests/` (None when it cannot be stat'ed: the listing says why)."""
    try:
        st = os.stat(os.path.join(workspace, CHANNEL_DIR, ChannelPaths.REQUESTS), follow_symlinks=False)
    except (OSError, ValueError):
        return None
    return DirStamp(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_nlink)


@dataclass(slots=True)
class _Batch:
    keys: list[str]
    paths: list[str]
    started: float
    wall_ns: int
    stamps: list[DirStamp | None] = field(default_factory=list)
    cut: int = -1  # >= 0: only the first `cut` keys are this batch's (the rest were handed back)
    applied: int = 0  # the first `applied` stamps were fed to the schedule already (at the cut)


class Poller:
    """Looks at the polled channels on the schedule's clock; `on_changed(key)` for each one to list."""

    def __init__(
        self,
        schedule: PollSchedule,
        clock: Callable[[], float],
        deadline: Callable[[], float],
        on_changed: Callable[[str], None],
        stamp: Callable[[str], DirStamp | None] = stamp_of,
    ) -> None:
        self.schedule = schedule
        self.clock = clock
        self.deadline = deadline
        self.on_changed = on_changed
        self.stamp = stamp
        self._batches: list[_Batch] = []  # running or stuck; a batch leaves it when its thread returns

    def stuck(self) -> list[_Batch]:
        return [b for b in self._batches if b.cut >= 0]

    def tick(self, token: EventLoopToken, paths: Callable[[str], str | None]) -> None:
        """(event loop) Give up on batches past their deadline, then start batches for the looks now due."""
        now = self.clock()
        for b in self._batches:
            if b.cut < 0 and now - b.started > self.deadline():
                i = min(len(b.stamps), len(b.keys) - 1)
                b.cut = i + 1
                self._apply(b, i, now)  # what it found before it stuck
                log.event("poll_overdue", ws=b.keys[i], seconds=round(now - b.started, 1))
                self.on_changed(b.keys[i])  # its turn meets the hang and shows it
                for key in b.keys[i + 1 :]:
                    self.schedule.skipped(key, now)
        running = sum(1 for b in self._batches if b.cut < 0)
        while running < MAX_RUNNING and len(self.stuck()) < MAX_STUCK:
            keys = self.schedule.due(now, BATCH)
            if not keys:
                return
            batch = _Batch([], [], now, time.time_ns())
            for key in keys:
                path = paths(key)
                if path is None:
                    continue  # no longer served: the schedule forgets it at its next sync
                batch.keys.append(key)
                batch.paths.append(path)
            if not batch.keys:
                continue
            self._batches.append(batch)
            running += 1
            threading.Thread(target=self._run, args=(token, batch), name="poll", daemon=True).start()

    def _run(self, token: EventLoopToken, batch: _Batch) -> None:
        stamp = self.stamp
        for i, path in enumerate(batch.paths):
            if 0 <= batch.cut <= i:
                break
            batch.stamps.append(stamp(path))
        call_soon(token, self._returned, batch)

    def _returned(self, batch: _Batch) -> None:
        """(event loop) Feed a batch's stamps to the schedule; mark the channels to list."""
        self._batches.remove(batch)
        n = len(batch.stamps) if batch.cut < 0 else min(batch.cut, len(batch.stamps))
        self._apply(batch, n, self.clock())

    def _apply(self, batch: _Batch, n: int, now: float) -> None:
        """Feed the stamps `batch.applied:n` to the schedule (each once)."""
        for i in range(batch.applied, n):
            key = batch.keys[i]
            if self.schedule.looked(key, batch.stamps[i], batch.wall_ns, now):
                metrics.POLL_LOOKS.labels("listed").inc()
                self.on_changed(key)
            else:
                metrics.POLL_LOOKS.labels("unchanged").inc()
        batch.applied = max(batch.applied, n)
