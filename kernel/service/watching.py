"""The watches of served channels' `requests/`: `Watches`.

Each served channel is watched with inotify (kernel.io.watch's `Watcher`, one watch per channel's requests/) or,
where its filesystem raises no events (or the watch cannot be added), polled: which ones are polled is the serve
core's (kernel.core.serving), told by the event loop what each watch made (`watch_one`'s and `watch_all`'s
results, `on_watched`). Admission and looks watch a channel while they have it open (`watch_one`); a channel whose
watch was lost, or that is served anew, is watched again in the background (`watch_all`, then `start_queued`).

Invariants, and why they hold:
- No channel is opened on the event loop or the store worker: `watch_all` only queues; the event loop starts each
  queued re-watch as a task (`start_queued`) that opens the channel in the channel look pool, at most
  one in flight per workspace (`in_flight`). A channel that hangs there shows as the workspace's problem once
  overdue (the service's overdue callback looks the row up in `in_flight`) and holds nothing else.
- Nothing committed while a channel was not watched is missed: after a re-watch, `on_watched` has its whole
  requests/ listed.
- A watch that fails is never silent and never drops the channel for good: an OSError (e.g. the inotify watch
  limit) polls the channel instead; a channel moved or refused is left to the rescan, which re-watches it once it
  is back; each problem is logged once.
- Owns the queue and the watches in flight, touched by the event loop only (a watch's thread returns what it
  made), and the problems it logged once (by the watch's thread); the `Watcher` itself is the service's
  (`watcher()`, None when every channel is polled).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import anyio.abc

from channel import safefs
from channel.paths import ChannelPaths
from kernel.core.records import WorkspaceRow
from kernel.io import crash, log
from kernel.io.watch import Watcher
from kernel.service.chanio import ChannelIO, ChannelIOAbandoned

# A channel that cannot be opened or read (the service retries it at every rescan and logs it once).
CHANNEL_ERRORS = (safefs.ChannelMoved, safefs.Refused, OSError)


def channel_problem(exc: Exception) -> str:
    """What a channel error (CHANNEL_ERRORS) says, as a workspace's problem and in the log."""
    return f"{type(exc).__name__}: {exc}"


class Watches:
    """Watches (or polls) the requests/ of the channels the service serves, and watches them again in the
    channel look pool `looks` when asked. The service gives it `watcher` (its Watcher, or None), `served` (whether
    a workspace is still served: a re-watch of one no longer served does nothing) and `on_watched` (a re-watch
    ended, with what it made, as `watch_one` says: list the workspace's requests/)."""

    def __init__(
        self,
        looks: ChannelIO,
        *,
        watcher: Callable[[], Watcher | None],
        served: Callable[[str], bool],
        on_watched: Callable[[str, bool | None], None],
    ) -> None:
        self.looks = looks
        self.watcher = watcher
        self.served = served
        self.on_watched = on_watched
        # Rows whose channel a store step asked the loop to watch again (`watch_all`), taken by `start_queued`, and
        # the watches in flight (`_rewatch`), by workspace.
        self._next: list[WorkspaceRow] = []
        self.in_flight: dict[str, WorkspaceRow] = {}
        self._problems: dict[str, str] = {}

    def watch_all(self, rows: list[WorkspaceRow], only: set[str] | None = None) -> list[str]:
        """(event loop) Watch the requests/ of these rows' channels (those in `only`) again: a poll-mode one is
        polled (the keys returned); the others are queued, and opened and watched each in the channel look pool
        (`start_queued`, `_rewatch`). No channel is opened here."""
        polled = []
        for row in rows:
            if only is not None and row.key not in only:
                continue
            if row.watch == "poll" or self.watcher() is None:
                polled.append(row.key)
            else:
                self._next.append(row)
        return polled

    def start_queued(self, tg: anyio.abc.TaskGroup | None) -> None:
        """(event loop) Watch again each row `watch_all` queued, in the background (`_rewatch`), unless its
        re-watch is in flight already; without a task group (not running) the queue is dropped."""
        watches, self._next = self._next, []
        if tg is None:
            return
        for row in watches:
            if row.key not in self.in_flight:
                self.in_flight[row.key] = row
                tg.start_soon(self._rewatch, row)

    async def _rewatch(self, row: WorkspaceRow) -> None:
        """Watch `row`'s requests/ again (`_watch_io`) in the channel look pool, in `row`'s turn; then its whole
        requests/ is listed (what was committed while it was not watched). A channel that hangs there shows as the
        workspace's problem once overdue (the service's `_look_overdue`) and holds nothing else."""
        try:
            polled = await self.looks.run(row.key, self._watch_io, row)
        except ChannelIOAbandoned:
            return
        finally:
            self.in_flight.pop(row.key, None)
        self.on_watched(row.key, polled)

    def _watch_io(self, row: WorkspaceRow) -> bool | None:
        """(channel look pool) Open `row`'s channel and watch its requests/, if it is still served; what it made
        (`watch_one`)."""
        if not self.served(row.key):
            return None
        crash.hang_point("watch", row.path)
        try:
            with safefs.open_channel(row.path, row.identity) as ch:
                return self.watch_one(row, ch)
        except CHANNEL_ERRORS as exc:
            self._watch_failed(row, exc)
            return None

    def watch_one(self, row: WorkspaceRow, ch: safefs.Channel) -> bool | None:
        """Watch the requests/ of `row`'s open channel (or poll it: its filesystem raises no events, or the
        inotify watch cannot be added). True: polled; False: watched with inotify; None: neither (the channel
        moved or was refused: left to the rescan). On a look's thread: it changes the `Watcher`'s watches (which
        has its own lock) and the problems logged, nothing the loop reads."""
        watcher = self.watcher()
        if row.watch == "poll" or watcher is None:
            return True
        try:
            fd = ch.subdir(ChannelPaths.REQUESTS)
            try:
                watcher.add(row.key, fd)
            finally:
                os.close(fd)
            self._problems.pop(row.key, None)
            return False
        except (safefs.ChannelMoved, safefs.Refused) as exc:
            self._watch_failed(row, exc)
            return None
        except OSError as exc:
            # E.g. the inotify watch limit: poll this channel instead of missing it.
            log.event("watch_failed", logging.WARNING, ws=row.key, problem=str(exc), fallback="poll")
            return True

    def _watch_failed(self, row: WorkspaceRow, exc: Exception) -> None:
        # Left to the rescan, which reports it and re-watches once the channel is back; logged once.
        if self._problems.get(row.key) != str(exc):
            self._problems[row.key] = str(exc)
            log.event("watch_failed", logging.WARNING, ws=row.key, problem=str(exc))

    def forget(self, key: str) -> None:
        """`key` is no longer served: not watched (nor polled: the service tells the serve core), and a watch
        problem logged of it is logged again if it comes back."""
        self._problems.pop(key, None)
        watcher = self.watcher()
        if watcher is not None:
            watcher.remove(key)
