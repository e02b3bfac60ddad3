"""Progress: `results/<seq>/progress.json`, each task of a sleep in flight as the store last recorded it.

A client follows a sleep by looking at this one file (spec 8.7), so a task's end reaches a waiting agent within its
look interval, with no request per look. The file is written whenever a task of the sleep changes state (its job
id recorded at dispatch, its start, its end, a cancel), once the change is in the store:

- the sleep's rows are read in a store step (sqlite only) and the file's bytes made there from memory; the write
  goes to the heavy pool, in the workspace's turn (kernel.service.heavy), never on the store worker;
- writes of one sleep never overlap and each reads the store afresh, so the file on disk is never older than a
  write that finished before it: changes that arrive while a write runs are folded into one more write;
- the file is a view, never the truth: nothing reads it back, a write that fails (the channel moved, the agent put
  a directory in its place) is logged once and skipped, and the wake stays what a sleep's results are. A woken or
  rejected sleep is not written again.
- at dispatch the file is written before the sleep is answered (`publish` awaited), so a client that reads an
  `accepted` answer and finds no progress file knows this kernel could not write one.
- the environment build a sleep waits for (kernel.service.building) is shown as the executor last told it
  (`environment`: building, its start, ready, failed), kept in memory from the build's want until the sleep is
  woken; a restart shows the build it starts again, if any.
"""

from __future__ import annotations

import logging
import os
from collections import deque

import anyio

from channel import safefs
from channel.messages import EnvironmentBuild, encode
from channel.paths import ChannelPaths
from kernel.core import rules
from kernel.core.records import WorkspaceRow
from kernel.io import log as klog
from kernel.io.store import StoreWorker, timestamp
from kernel.service.heavy import HeavyPool

_DONE = frozenset({"woken", "rejected"})


def write_progress(ws: WorkspaceRow, seq: int, data: bytes) -> None:
    """(heavy pool; no store access) Atomically make `results/<seq>/progress.json` hold `data`."""
    with safefs.open_channel(ws.path, ws.identity) as ch:
        fd = ch.delivery_dir((str(seq),))
        try:
            safefs.write_atomic_at(fd, ChannelPaths.PROGRESS, data)
        finally:
            os.close(fd)


class Progress:
    """Writes each sleep's progress file after its tasks change (`changed`, from the event loop, returns at once;
    `publish`, awaited)."""

    def __init__(self, worker: StoreWorker, heavy: HeavyPool) -> None:
        self.worker = worker
        self.store = worker.store
        self.heavy = heavy
        self._locks: dict[tuple[str, int], anyio.Lock] = {}
        self._dirty: set[tuple[str, int]] = set()
        self._draining: set[tuple[str, int]] = set()
        self._problems: dict[tuple[str, int], str] = {}
        self._queue: deque[tuple[str, int]] = deque()  # sleeps for `run` to start a drain for
        self._wakeup: anyio.Event | None = None  # made by `run`, in the event loop
        # The build each sleep waits (or waited) for, as the executor last told it (`environment`).
        self._environments: dict[tuple[str, int], EnvironmentBuild] = {}

    def environment(self, key: str, seq: int, build: EnvironmentBuild | None) -> None:
        """(event loop) The environment build the sleep waits for changed (None: nothing to show): its file is
        rewritten soon, or at once by an awaited `publish`."""
        if build is None:
            if self._environments.pop((key, seq), None) is None:
                return
        elif self._environments.get((key, seq)) == build:
            return
        else:
            self._environments[(key, seq)] = build
        self.changed(key, seq)

    def changed(self, key: str, seq: int) -> None:
        """(event loop) A task of the sleep changed state in the store: its file is rewritten soon (`run`)."""
        if (key, seq) in self._dirty:
            return
        self._dirty.add((key, seq))
        if (key, seq) not in self._draining:  # a drain running for it sees it dirty
            self._queue.append((key, seq))
            if self._wakeup is not None:
                self._wakeup.set()

    async def run(self) -> None:
        """Write the files `changed` asked for, each sleep in a task of its own (one slow channel delays only
        its own workspace's files)."""
        async with anyio.create_task_group() as tg:
            while True:
                self._wakeup = anyio.Event()  # before the queue is emptied: a later `changed` sets it
                while self._queue:
                    sleep = self._queue.popleft()
                    if sleep not in self._draining:
                        self._draining.add(sleep)
                        tg.start_soon(self._drain, sleep)
                await self._wakeup.wait()

    async def _drain(self, sleep: tuple[str, int]) -> None:
        try:
            while sleep in self._dirty:
                self._dirty.discard(sleep)
                await self.publish(*sleep)
        finally:
            self._draining.discard(sleep)

    async def publish(self, key: str, seq: int) -> None:
        """Write the sleep's progress file now, from the store as it is (nothing for a woken or rejected sleep, or
        one with no tasks)."""
        lock = self._locks.setdefault((key, seq), anyio.Lock())
        try:
            async with lock:
                got = await self.worker.call(self._inputs, key, seq)
                if got is None:
                    return
                ws, data = got
                try:
                    await self.heavy.run(key, write_progress, ws, seq, data)
                except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
                    self._problem(key, seq, f"{type(e).__name__}: {e}")
                    return
                self._problems.pop((key, seq), None)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._locks.pop((key, seq), None)

    def _inputs(self, key: str, seq: int) -> tuple[WorkspaceRow, bytes] | None:
        """(store worker) The workspace and the file's bytes; None when there is nothing to write."""
        sleep = self.store.sleep(key, seq)
        ws = self.store.workspace(key)
        if sleep is None or ws is None or sleep.state in _DONE or self.store.admin(key).unenrolled_at:
            self._environments.pop((key, seq), None)  # never shown again
            return None
        jobs = self.store.jobs_of(key, seq)
        if not jobs:
            return None
        build = self._environments.get((key, seq))
        return ws, encode(rules.progress_file(sleep, jobs, timestamp(), build))

    def _problem(self, key: str, seq: int, problem: str) -> None:
        if self._problems.get((key, seq)) != problem:
            self._problems[(key, seq)] = problem
            klog.event("progress_not_written", logging.WARNING, ws=key, seq=seq, problem=problem)
