"""The polled channels' looks: one `stat` of each `requests/` on threads of their own, in batches, fed to the
pure schedule (kernel.core.polling), which says which channels to list in full. The rescan's looks at every
served channel (its `requests/` and kernel.json: `evidence_of`, fed to kernel.core.polling.RescanLedger, which
says which channels to check in full) run the same way, on a `Poller` of their own.

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
- The batches run on threads the poller keeps (starting a thread per batch made the loop wait for each start):
  a thread that finished a batch waits for the next. So a poller has at most MAX_RUNNING + MAX_STUCK threads,
  idle ones included.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

from anyio.lowlevel import EventLoopToken
from prometheus_client import Counter

from channel.paths import CHANNEL_DIR, ChannelPaths
from kernel.core.polling import DirStamp, Evidence
from kernel.io import log, metrics
from kernel.io.loopcall import call_soon

# Looks per batch, stat'ed in turn by one thread. Batches running at once hand the GIL to each other at every
# `stat` (a thread switch each), so a batch is large: the idle looks of one grid slot at 10,000 channels (1,250)
# are one batch. A slow filesystem still gets parallel looks: the next slot's batch starts beside a late one.
BATCH: Final = 2048
MAX_RUNNING: Final = 4
MAX_STUCK: Final = 16


@functools.lru_cache(maxsize=1 << 16)
def _looked_at(workspace: str) -> tuple[str, str]:
    """The paths a look stats: the channel's `requests/` and its kernel.json (joined once per workspace, not at
    each of its looks)."""
    channel = os.path.join(workspace, CHANNEL_DIR)
    return os.path.join(channel, ChannelPaths.REQUESTS), os.path.join(channel, ChannelPaths.KERNEL_JSON)


def stamp_of(workspace: str) -> DirStamp | None:
    """The stamp of the channel's `requests/` (None when it cannot be stat'ed: the listing says why)."""
    try:
        st = os.stat(_looked_at(workspace)[0], follow_symlinks=False)
    except (OSError, ValueError):
        return None
    return DirStamp(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_nlink)


def evidence_of(workspace: str) -> Evidence:
    """What the rescan looks at: the stamp of the channel's `requests/` and the `lstat` of its kernel.json (as
    kernel.io.enroll.Fingerprint), None where a stat failed (the check says why). Attributes only, as `stamp_of`."""
    try:
        st = os.stat(_looked_at(workspace)[1], follow_symlinks=False)
        owner = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except (OSError, ValueError):
        owner = None
    return stamp_of(workspace), owner


S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


class Schedule(Protocol[S_contra]):
    """What a `Poller` drives (kernel.core.polling: PollSchedule, RescanLedger)."""

    def due(self, now: float, limit: int) -> list[str]: ...
    def looked(self, key: str, stamp: S_contra, wall_ns: int, now: float) -> bool: ...
    def skipped(self, key: str, now: float) -> None: ...


@dataclass(slots=True)
class _Batch(Generic[S]):
    keys: list[str]
    paths: list[str]
    started: float
    wall_ns: int
    stamps: list[S] = field(default_factory=list)
    cut: int = -1  # >= 0: only the first `cut` keys are this batch's (the rest were handed back)
    applied: int = 0  # the first `applied` stamps were fed to the schedule already (at the cut)


class Poller(Generic[S]):
    """Looks at channels on the schedule's clock (`stamp` of each); `on_changed(key)` for each one the schedule
    says to list (or check) in full."""

    def __init__(
        self,
        schedule: Schedule[S],
        clock: Callable[[], float],
        deadline: Callable[[], float],
        on_changed: Callable[[str], None],
        stamp: Callable[[str], S],
        name: str = "poll",
        counter: Counter = metrics.POLL_LOOKS,
        outcomes: tuple[str, str] = ("listed", "unchanged"),
    ) -> None:
        self.schedule = schedule
        self.clock = clock
        self.deadline = deadline
        self.on_changed = on_changed
        self.stamp = stamp
        self.name = name
        self._changed, self._unchanged = (counter.labels(o) for o in outcomes)
        self._batches: list[_Batch[S]] = []  # running or stuck; a batch leaves it when its thread returns
        # The poller's threads: those waiting for a batch take them from `_queue` (`_idle` of them, counted
        # under `_mutex`; `_submit` starts a thread only when none waits).
        self._queue: queue.SimpleQueue[tuple[EventLoopToken, _Batch[S]]] = queue.SimpleQueue()
        self._mutex = threading.Lock()
        self._idle = 0

    def stuck(self) -> list[_Batch[S]]:
        return [b for b in self._batches if b.cut >= 0]

    def running(self) -> bool:
        """Whether a batch runs that is not past its deadline yet (`tick` gives up on it once it is)."""
        return any(b.cut < 0 for b in self._batches)

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
            batch: _Batch[S] = _Batch([], [], now, time.time_ns())
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
            self._submit(token, batch)

    def _submit(self, token: EventLoopToken, batch: _Batch[S]) -> None:
        with self._mutex:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._queue.put((token, batch))
        if start:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        """(a poller thread) Run batches, one after another, for as long as the process lives."""
        while True:
            token, batch = self._queue.get()
            stamp = self.stamp
            for i, path in enumerate(batch.paths):
                if 0 <= batch.cut <= i:
                    break
                batch.stamps.append(stamp(path))
            # Idle before the batch is handed back: a thread counts as busy only while its batch is in
            # `_batches`, so a new thread starts only when all of them are, and there are at most as many threads
            # as batches may be running or stuck.
            with self._mutex:
                self._idle += 1
            with contextlib.suppress(RuntimeError):  # the loop is gone (the process is exiting)
                call_soon(token, self._returned, batch)

    def _returned(self, batch: _Batch[S]) -> None:
        """(event loop) Feed a batch's stamps to the schedule; mark the channels to list."""
        self._batches.remove(batch)
        n = len(batch.stamps) if batch.cut < 0 else min(batch.cut, len(batch.stamps))
        self._apply(batch, n, self.clock())

    def _apply(self, batch: _Batch[S], n: int, now: float) -> None:
        """Feed the stamps `batch.applied:n` to the schedule (each once)."""
        looked, changed = self.schedule.looked, 0
        for i in range(batch.applied, n):
            key = batch.keys[i]
            if looked(key, batch.stamps[i], batch.wall_ns, now):
                changed += 1
                self.on_changed(key)
        if n > batch.applied:
            self._changed.inc(changed)
            self._unchanged.inc(n - batch.applied - changed)
        batch.applied = max(batch.applied, n)
