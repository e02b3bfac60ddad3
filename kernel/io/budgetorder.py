"""The order of `budget.json` writes, per workspace: an older balance never replaces a newer one, and the file
converges to the store's balance.

`budget.json` is written from several threads of the kernel: the channel I/O pool (after a recorded sleep or
cancel, with a continuation's answer, in the after-ready refresh, and when another process changed the balance),
the heavy pool (with a wake) and store steps (a rescan's or a reload's refresh). Each write carries a balance read
in some store step, and the pools do not order their calls with each other, so without this an older balance could
land last: a continuation's `accepted`, whose balance was read before its jobs ended, written after the wake had
written the settled one (its channel I/O was slow), left `budget.json` showing GPU time still reserved after the
wake.

Invariant (within one kernel): for each workspace the file holds the balance of the latest store step among the
writes that ran.
- Each write carries a stamp taken in the store step that read its balance (`stamp()`). Store steps are
  serialised (the store worker's lock), so stamps follow their order, and a balance read in a later step is at
  least as new as one read in an earlier step.
- `write` runs a workspace's write only if no later-stamped write for it has run, under that workspace's lock, so
  the check and the write are one step. The lock is held only across that workspace's own `budget.json` write:
  a hung channel holds its own workspace's writers, never another's.
A write that raises counts as not run.

Across processes (the operator's `syscall-kernel budget` and `enroll` change the balance in their own process):
stamps are not comparable across processes, so no other process writes the budget.json of a channel a kernel
serves. Such a process writes it only while it holds the channel's lock itself (kernel.io.chanlock: then no kernel
serves the channel, and none can start to until it lets go), reading the balance after taking it
(kernel.io.enroll.publish_budget). A kernel that serves the channel instead notices the other process's commit at
its next poll tick (sqlite's data_version moves only on other connections' commits), finds the store's balance
differing from the one it last wrote (`shows`), and rewrites budget.json through `write` with a stamp of a store
step after that commit: later than every stamp read before the commit, so a delayed write of the older balance is
skipped, and the newer one lands.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from kernel.core.budget import Balance


class BudgetOrder:
    def __init__(self) -> None:
        self._stamps = itertools.count(1)
        # workspace -> the stamp and balance of the last write that ran
        self._written: dict[str, tuple[int, Balance]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._mutex = threading.Lock()

    def stamp(self) -> int:
        """The position of the calling store step among all: call it in the step that reads the balance."""
        with self._mutex:
            return next(self._stamps)

    def write(self, key: str, stamp: int, balance: Balance, write: Callable[[Balance], None]) -> bool:
        """Run `write(balance)` (it writes `key`'s budget.json) unless a write with a later stamp already ran for
        `key`; whether it ran."""
        with self._mutex:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            last = self._written.get(key)
            if last is not None and stamp < last[0]:
                return False
            write(balance)
            self._written[key] = (stamp, balance)
            return True

    def shows(self, key: str, balance: Balance) -> bool:
        """Whether the last write that ran for `key` wrote `balance` (False when none ran)."""
        last = self._written.get(key)
        return last is not None and last[1] == balance
