"""The order of one kernel's `budget.json` writes, per workspace: an older balance never replaces a newer one.

`budget.json` is written from several threads: the channel I/O pool (after a recorded sleep or cancel, with a
continuation's answer, in the after-ready refresh), the heavy pool (with a wake) and store steps (a rescan's or a
reload's refresh). Each write carries a balance read in some store step, and the pools do not order their calls
with each other, so without this an older balance could land last: a continuation's `accepted`, whose balance was
read before its jobs ended, written after the wake had written the settled one (its channel I/O was slow), left
`budget.json` showing GPU time still reserved after the wake.

Invariant: for each workspace the file holds the balance of the latest store step among the writes that ran.
- Each write carries a stamp taken in the store step that read its balance (`stamp()`). Store steps are
  serialised (the store worker's lock), so stamps follow their order, and a balance read in a later step is at
  least as new as one read in an earlier step.
- `write` runs a workspace's write only if no later-stamped write for it has run, under that workspace's lock, so
  the check and the write are one step. The lock is held only across that workspace's own `budget.json` write:
  a hung channel holds its own workspace's writers, never another's.
A write that raises counts as not run. Writes made outside the kernel (`syscall-kernel budget`, its own process)
are not ordered here; the kernel's next write of that workspace publishes the store's balance again.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable


class BudgetOrder:
    def __init__(self) -> None:
        self._stamps = itertools.count(1)
        self._written: dict[str, int] = {}  # workspace -> the stamp of the last write that ran
        self._locks: dict[str, threading.Lock] = {}
        self._mutex = threading.Lock()

    def stamp(self) -> int:
        """The position of the calling store step among all: call it in the step that reads the balance."""
        with self._mutex:
            return next(self._stamps)

    def write(self, key: str, stamp: int, write: Callable[[], None]) -> bool:
        """Run `write` (it writes `key`'s budget.json) unless a write with a later stamp already ran for `key`;
        whether it ran."""
        with self._mutex:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if stamp < self._written.get(key, 0):
                return False
            write()
            self._written[key] = stamp
            return True
