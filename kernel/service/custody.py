"""Which channels this kernel holds, and why it does not hold the others: `Custody`.

The kernel serves a channel only while it holds the channel's lock (kernel.io.chanlock: so no other kernel answers
it) and no other kernel's store owns it (its kernel.json). `Custody` keeps that record: the locks held (`locks`),
the channels another store owns (`foreign`), those whose lock another process holds (`held_elsewhere`, with why),
and the channels that cannot be opened or read (logged once per problem). The service's admission and looks ask
it to take a lock (`claim`) before anything is written to a channel, and tell it what a failed check meant
(`not_served`) or that a channel is ours again (`served_again`).

Invariants, and why they hold:
- One place decides what a failed start-up or rescan check of a channel means (`not_served`): another store owns
  it (its lock is let go, so that kernel can take it), another process holds its lock (not served, nor written
  to, until it lets go), or it cannot be opened or read (retried at every rescan). Nothing was written to the
  channel.
- A lock let go (unenrolled, taken over, held elsewhere) is closed on an Unlocker's thread, never on the store
  worker: on a hung network filesystem that close is the server's unlock, which blocks.
- Each change of a channel's state is logged once, and shown as its workspace's problem; the methods that write
  the store (`served_again`, `not_served`, `owned_elsewhere`) are store steps (on the store worker, or under its
  lock: the service's `_store_step`).
"""

from __future__ import annotations

import logging

from channel import safefs
from kernel.core.records import WorkspaceRow
from kernel.io import chanlock, log
from kernel.io import enroll as enrollment
from kernel.io.store import Store


class Custody:
    """The locks of the channels this kernel serves, the channels it does not serve (owned by another store, their
    lock held elsewhere) and the channel problems it logged; `store` records what a workspace's status shows."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # The lock of every channel this kernel serves (kernel.io.chanlock; one let go is closed on an Unlocker's
        # thread, never on the store worker: on a hung network filesystem that close blocks), and the channels whose
        # lock another process holds (with why), retried at each rescan.
        self.locks = chanlock.ChannelLocks(close=chanlock.Unlocker().close)
        self.held_elsewhere: dict[str, str] = {}
        # Channels whose kernel.json names another kernel's store.
        self.foreign: set[str] = set()
        self._unlocked: set[str] = set()
        self._channel_problems: dict[str, str] = {}

    def claim(self, key: str, ch: safefs.Channel) -> str | None:
        """Take (or keep) the channel's lock before anything is written to it; why not, or None."""
        try:
            return self.locks.hold(key, ch)
        except chanlock.Unsupported as exc:
            if key not in self._unlocked:
                self._unlocked.add(key)
                log.event("channel_lock_unsupported", logging.WARNING, ws=key, problem=str(exc))
            return None

    def served_again(self, row: WorkspaceRow) -> None:
        """(a store step) The channel is ours and locked: forget that it was another store's or held elsewhere."""
        self.foreign.discard(row.key)
        if self.held_elsewhere.pop(row.key, None) is not None:
            log.event("channel_lock_taken", ws=row.key)
            with self.store.transaction():
                self.store.set_problem(row.key, None)

    def not_served(self, row: WorkspaceRow, exc: Exception) -> None:
        """(a store step) The one place that decides what a failed start-up or rescan check of `row`'s channel
        (the service's `_admit_io`, `_refresh_io`) means: another kernel's store owns it, another process holds
        its lock, or it cannot be opened or read. Nothing was written to the channel."""
        if isinstance(exc, enrollment.OwnedElsewhere):
            self.owned_elsewhere(row, exc)
        elif isinstance(exc, enrollment.HeldElsewhere):
            self._lock_held_elsewhere(row, str(exc))
        else:
            self.channel_problem(row, exc)

    def channel_problem(self, row: WorkspaceRow, exc: Exception) -> None:
        """`row`'s channel cannot be opened or read: logged once per problem (it is retried at every rescan)."""
        problem = f"{type(exc).__name__}: {exc}"
        if self._channel_problems.get(row.key) != problem:  # retried at every rescan: logged once
            self._channel_problems[row.key] = problem
            log.event("channel_problem", logging.WARNING, ws=row.key, problem=problem)

    def channel_checked(self, key: str) -> None:
        """`key`'s channel was opened and checked: a problem it shows again is logged again."""
        self._channel_problems.pop(key, None)

    def _lock_held_elsewhere(self, row: WorkspaceRow, why: str) -> None:
        """Another process holds the channel's lock: not served here (nor written to) until it lets go."""
        self.locks.release(row.key)
        if self.held_elsewhere.get(row.key) != why:
            self.held_elsewhere[row.key] = why
            log.event("channel_held_elsewhere", logging.WARNING, ws=row.key, problem=why)
            with self.store.transaction():
                self.store.set_problem(row.key, why)

    def owned_elsewhere(self, row: WorkspaceRow, exc: enrollment.OwnedElsewhere) -> None:
        """(a store step) Another kernel's store took the channel over: stop serving it (its requests are that
        kernel's) and let its lock go, so that kernel can take it."""
        self.locks.release(row.key)
        if row.key not in self.foreign:
            self.foreign.add(row.key)
            log.event(
                "channel_owned_elsewhere",
                logging.WARNING,
                ws=row.key,
                store=exc.owner.store,
                state_dir=exc.owner.state_dir,
            )
            with self.store.transaction():
                self.store.set_problem(
                    row.key,
                    f"owned by another kernel's store {exc.owner.store} "
                    f"(state_dir {exc.owner.state_dir}); not served here",
                )
