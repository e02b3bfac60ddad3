"""Heavy work off the hot path: bounded threads, one job at a time per workspace, first come first served.

The store worker (`StoreWorker`, one thread) runs every sqlite step and the pipeline's passes, so whatever runs
on it delays every workspace's answers. Heavy work (copying up to gigabytes of artifacts, writing a wake, a
snapshot's git processes) therefore runs here instead, and only its bookkeeping goes back to the store worker.

Invariants: at most `size` heavy jobs run at once (threads and processes are bounded); a workspace runs at most
one at a time (its per-workspace lock is taken BEFORE a slot is asked for, so a workspace with a queue of heavy
jobs holds at most one place in the slot queue); slots are granted first come first served (anyio's
CapacityLimiter is FIFO), so every workspace gets a turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

HEAVY_SLOTS: Final = 4


class HeavyPool:
    def __init__(self, size: int = HEAVY_SLOTS) -> None:
        self._slots = anyio.CapacityLimiter(size)
        self._locks: dict[str, anyio.Lock] = {}
        self._users: dict[str, int] = {}

    @property
    def workspaces(self) -> int:
        """How many workspaces have heavy work running or waiting."""
        return len(self._locks)

    async def run(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a pool thread, in `key`'s turn. Not abandoned on cancel: a started copy finishes."""

        async def call() -> T:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._slots)

        return await self._turn(key, call)

    async def run_async(self, key: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await fn(*args)` (subprocesses, say) holding a slot, in `key`'s turn."""

        async def call() -> T:
            async with self._slots:
                return await fn(*args)

        return await self._turn(key, call)

    async def _turn(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
        lock = self._locks.setdefault(key, anyio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                return await call()
        finally:
            self._users[key] -= 1
            if not self._users[key]:  # nobody else waits on this workspace's lock: forget it
                del self._users[key]
                del self._locks[key]
