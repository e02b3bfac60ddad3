"""Heavy work off the hot path: bounded threads, one job at a time per workspace, first come first served, and a
deadline.

The store worker (`StoreWorker`, one thread) runs every sqlite step and the pipeline's passes, so whatever runs
on it delays every workspace's answers. Heavy work (copying up to gigabytes of artifacts, writing a wake, a
snapshot's git processes) therefore runs here instead, and only its bookkeeping goes back to the store worker.
The rule: whatever the service does with one workspace's files (its tree and .git, its channel outside the
request path, its repository in the kernel, the writing of its run directories) runs here, in that workspace's
turn; a plain thread is left only for the kernel's own files (the environment cache; the backends' exit records,
read in one batch across workspaces: kernel.backends.slurm.backend, "File I/O"), and says so where it is made.

The pool is the channel I/O pool's mechanism (kernel.service.chanio.ChannelIO) with a longer deadline, so the same
invariants hold, for the same reasons:
- at most `size` heavy jobs hold a slot; a workspace runs at most one at a time (its lock is taken BEFORE a slot
  is asked for and held until the job returns, even past its deadline), and slots are granted first come first
  served, so every workspace gets a turn;
- a job still running `deadline` seconds after it started (a workspace on a hung network filesystem) is overdue:
  it is logged once (`event=heavy_overdue`), shows in `syscall-kernel status` (the kernel's status line, through
  `degraded()`), and gives its slot back, so other workspaces' snapshots and wakes go on while nothing more starts
  for that workspace; at most chanio.OVERDUE_MAX jobs give their slot back. When it returns: `event=heavy_returned`
  and the problem clears;
- a started job is not abandoned when its caller is cancelled: a started copy finishes (`finish_started`). The stop
  does not wait for a hung one: SIGTERM's deadline (kernel.service.loop.arm_stop_deadline) ends the process, and
  the threads are daemon threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final, TypeVar

from kernel.io.log import event
from kernel.io.store import timestamp
from kernel.service.chanio import ChannelIO

T = TypeVar("T")

HEAVY_SLOTS: Final = 4


class HeavyPool:
    def __init__(self, deadline: float | Callable[[], float], *, size: int = HEAVY_SLOTS) -> None:
        self._pool = ChannelIO(
            deadline,
            size=size,
            on_overdue=self._overdue,
            on_returned=self._returned,
            finish_started=True,
            thread_name="heavy",
        )

    @property
    def deadline(self) -> float:
        """Seconds a heavy job may run before it is overdue, read at each check (ChannelIO.deadline): given the
        live config's, it follows a SIGHUP (kernel.service.reload)."""
        return self._pool.deadline

    @property
    def workspaces(self) -> int:
        """How many workspaces have heavy work running or waiting."""
        return self._pool.workspaces

    @property
    def overdue(self) -> dict[str, float]:
        """Workspace -> when its overdue heavy job started (time.time())."""
        return self._pool.overdue

    async def run(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a pool thread, in `key`'s turn. Not abandoned on cancel: a started copy finishes."""
        return await self._pool.run(key, fn, *args)

    def degraded(self) -> str | None:
        """The overdue workspaces, as `syscall-kernel status` shows them; None when there are none."""
        if not self._pool.overdue:
            return None
        since = ", ".join(f"{k} since {timestamp(t)}" for k, t in sorted(self._pool.overdue.items()))
        return (
            f"heavy work (snapshot, artifact copy, wake) has not returned after {self._pool.deadline:g} s "
            f"(a hung filesystem?) in {since}; nothing more heavy starts for those workspaces until it returns, "
            "other workspaces go on"
        )

    async def _overdue(self, key: str, since: float) -> None:
        event(
            "heavy_overdue",
            logging.WARNING,
            ws=key,
            since=timestamp(since),
            deadline_s=self._pool.deadline,
        )

    async def _returned(self, key: str) -> None:
        event("heavy_returned", ws=key)
