"""The locks of the channels this kernel holds: `Custody`.

The kernel serves a channel only while it holds the channel's lock (kernel.io.chanlock: so no other kernel answers
it). `Custody` holds those locks and nothing else: the service's admission, looks and enrollment take a channel's
lock (`claim`) before anything is written to it; a look that finds the channel another store's or its lock held by
another process lets it go (`release`), and so does a take-over and an unenrollment (`keep_only`). Why a channel
is not served (another store owns it, another process holds its lock, it cannot be read) and the problem its
workspace shows are the serve core's (kernel.core.serving), told by what each look found.

Invariants, and why they hold:
- A lock let go (unenrolled, taken over, held elsewhere) is closed on an Unlocker's thread, never on the store
  worker nor on the event loop: on a hung network filesystem that close is the server's unlock, which blocks.
- A filesystem that cannot lock is logged once per channel (`channel_lock_unsupported`), and the channel is served
  without a lock.
- Written by the store worker and the channel look pool only under the store worker's lock (the service's store
  steps), except `claim`, which a look makes with the channel open (it touches only that channel's entry).
"""

from __future__ import annotations

import logging

from channel import safefs
from kernel.io import chanlock, log


class Custody:
    """The locks of the channels this kernel serves (kernel.io.chanlock)."""

    def __init__(self) -> None:
        # One let go is closed on an Unlocker's thread, never on the store worker: on a hung network filesystem that
        # close blocks.
        self.locks = chanlock.ChannelLocks(close=chanlock.Unlocker().close)
        self._unlocked: set[str] = set()  # the channels whose filesystem cannot lock (logged once each)

    def claim(self, key: str, ch: safefs.Channel) -> str | None:
        """Take (or keep) the channel's lock before anything is written to it; why not, or None."""
        try:
            return self.locks.hold(key, ch)
        except chanlock.Unsupported as exc:
            if key not in self._unlocked:
                self._unlocked.add(key)
                log.event("channel_lock_unsupported", logging.WARNING, ws=key, problem=str(exc))
            return None

    def holds(self, key: str) -> bool:
        """Whether this kernel holds `key`'s channel lock."""
        return self.locks.holds(key)

    def release(self, key: str) -> None:
        """(a store step) Let `key`'s lock go: another store owns the channel, or another process holds its lock,
        so that one can take it."""
        self.locks.release(key)

    def keep_only(self, enrolled: set[str]) -> None:
        """(a store step) Let the locks of the channels not `enrolled` (any more) go, and forget them."""
        self.locks.keep_only(enrolled)
        self._unlocked &= enrolled
