"""Background environment builds: a sleep whose locked environment is not built yet is answered at once.

Dispatch (kernel.service.dispatch) finds the cache entry of each tree's uv.lock; when one is cold it raises
`EnvironmentsCold`, the executor hands the sleep to `Builds.want` and answers it `accepted` with `building` (its
tasks PENDING, no job ids). The builds run here, in the executor's task group, at most
`[environment] max_builds` at once (a capacity limiter: never on the store worker, the channel I/O pool or the
heavy pool, so a 20-minute torch build holds nobody's channel), one per cache key whatever the number of sleeps
and workspaces waiting for it (kernel.io.envcache: an flock per key across processes). When a build is ready,
each sleep waiting for nothing else is given to `on_ready` (the executor dispatches it again: its environments
warm now, its tasks are submitted); when it fails, each sleep waiting for it is given to `on_failed` with uv's
message (the executor wakes it with `environment.failed`, refunded). When a build begins (it had waited for a
slot), each sleep waiting for it is given to `on_started` (its progress file shows the start).

What a sleep waits for is kept in memory only, from its dispatch until the executor `forget`s it: the store's
record of the sleep (`snapshotted`, its answer recorded) is what a restart resumes from (RealExecutor.recover
dispatches it again, which builds again: a build cut short by a crash leaves no entry, and its flock died with
the kernel). `view` and `log_tail` are read in store steps (status, tail): memory only, no file is read.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio

from channel import limits as L
from channel.messages import EnvironmentBuild
from kernel.io import envcache
from kernel.io import log as klog
from kernel.io.store import timestamp

# The most of a build's output kept in memory for `status` and `tail` (the whole log is builds/<key>.log).
LOG_TAIL_BYTES: Final = L.TAIL_VERB_MAX_BYTES
# The lines of it a status shows.
STATUS_LINES: Final = 5

Sleep = tuple[str, int]  # (workspace key, seq)


class EnvironmentsCold(Exception):
    """The sleep's launches need locked environments that are not built yet (each accepted and checked against
    its pyproject.toml): the executor builds them in the background and dispatches the sleep when they are."""

    def __init__(self, needed: Sequence[envcache.Prepared]) -> None:
        super().__init__(", ".join(p.key for p in needed))
        self.needed = tuple(needed)


@dataclass(slots=True, eq=False)
class _Build:
    prepared: envcache.Prepared
    waiters: set[Sleep] = field(default_factory=set)
    started_at: str | None = None
    tail: bytearray = field(default_factory=bytearray)
    printed: int = 0  # bytes uv printed in all

    def heard(self, chunk: bytes) -> None:
        self.printed += len(chunk)
        self.tail += chunk
        if len(self.tail) > 2 * LOG_TAIL_BYTES:
            del self.tail[: len(self.tail) - LOG_TAIL_BYTES]


@dataclass(slots=True)
class _Waiting:
    keys: set[str]  # the builds the sleep still waits for
    first: envcache.Prepared  # the one `view` shows (the sleep's own tree's, else its first)
    state: str = "building"


class Builds:
    """The builds in flight and the sleeps waiting for them."""

    def __init__(
        self,
        envs: envcache.EnvCache,
        slots: Callable[[], int],
        on_ready: Callable[[Sleep], Coroutine[object, object, None]],
        on_failed: Callable[[Sleep, str], Coroutine[object, object, None]],
        on_started: Callable[[Sleep], None] = lambda sleep: None,
    ) -> None:
        self.envs = envs
        self.on_started = on_started
        self._limiter = anyio.CapacityLimiter(max(1, slots()))
        self._slots = slots
        self.on_ready = on_ready
        self.on_failed = on_failed
        self._builds: dict[str, _Build] = {}
        self._waiting: dict[Sleep, _Waiting] = {}
        self._queue: deque[_Build] = deque()
        self._wakeup: anyio.Event | None = None

    # --- what the executor asks (event loop, or a store step: memory only) -----------------------------------

    def want(self, sleep: Sleep, needed: Sequence[envcache.Prepared]) -> None:
        """The sleep waits for these environments: each is built unless a build of it is in flight already."""
        if not needed:
            return
        keys = set()
        for p in needed:
            b = self._builds.get(p.key)
            if b is None:
                b = self._builds[p.key] = _Build(p)
                self._queue.append(b)
            b.waiters.add(sleep)
            keys.add(p.key)
        got = self._waiting.get(sleep)
        if got is None:
            self._waiting[sleep] = _Waiting(keys, needed[0])
        else:
            got.keys |= keys
            got.state = "building"
        klog.event(
            "environment_building",
            ws=sleep[0],
            seq=sleep[1],
            keys=",".join(sorted(keys)),
            lock=needed[0].project.lock_sha256[:12],
        )
        if self._wakeup is not None:
            self._wakeup.set()

    def waiting(self, sleep: Sleep) -> bool:
        """Whether the sleep waits for a build now."""
        got = self._waiting.get(sleep)
        return got is not None and got.state == "building"

    def view(self, sleep: Sleep, *, lines: int = 0) -> EnvironmentBuild | None:
        """The environment the sleep waits for (or waited for, until `forget`), with the last `lines` lines of
        its build's output; None when it never waited."""
        got = self._waiting.get(sleep)
        if got is None:
            return None
        b = self._builds.get(got.first.key)
        tail = ""
        if b is not None and lines:
            tail = _last_lines(bytes(b.tail), lines)
        state = got.state if got.state in ("building", "ready", "failed") else "building"
        return EnvironmentBuild(
            lock_sha256=got.first.project.lock_sha256,
            state=state,  # type: ignore[arg-type]  # one of the three, checked above
            started_at=b.started_at if b is not None else None,
            log_tail=tail,
        )

    def log_tail(self, sleep: Sleep, lines: int) -> tuple[str, int, bool] | None:
        """The last `lines` lines of the output of the build the sleep waits for (text, bytes uv printed so far,
        whether that is less than all of it); None when it waits for none."""
        got = self._waiting.get(sleep)
        b = None if got is None or got.state != "building" else self._builds.get(got.first.key)
        if b is None:
            return None
        kept = bytes(b.tail)
        text = _last_lines(kept, lines)
        shown = len(text.splitlines())
        return text, b.printed, b.printed > len(kept) or shown < len(_last_lines(kept, 1 << 30).splitlines())

    def forget(self, sleep: Sleep) -> None:
        """The sleep was dispatched or woke: nothing is kept of it."""
        self._waiting.pop(sleep, None)

    # --- the builds (the executor's task group) ------------------------------------------------------------

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                self._wakeup = anyio.Event()
                while self._queue:
                    tg.start_soon(self._one, self._queue.popleft())
                await self._wakeup.wait()

    async def _one(self, b: _Build) -> None:
        key = b.prepared.key
        self._limiter.total_tokens = max(
            1, self._slots()
        )  # a reload's new max_builds, from the next build on
        error: str | None = None
        try:
            async with self._limiter:
                b.started_at = timestamp()
                for sleep in sorted(b.waiters):  # (event loop) each waiting sleep's view now has its start
                    if sleep in self._waiting:
                        self.on_started(sleep)
                try:
                    ready, built = await self.envs.build(b.prepared, on_output=b.heard)
                except envcache.EnvironmentFailed as e:
                    error = str(e)
        finally:
            if self._builds.get(key) is b:
                del self._builds[key]
        if error is not None:
            klog.event(
                "environment_failed", logging.WARNING, key=key, sleeps=len(b.waiters), error=error[:500]
            )
        else:
            klog.event(
                "environment_built",
                key=key,
                built=built,
                packages=len(ready.packages),
                warm_s=ready.warm_seconds if built else 0.0,
                sleeps=len(b.waiters),
            )
            removed = await anyio.to_thread.run_sync(
                self.envs.prune
            )  # the kernel's own cache: a plain thread
            if removed:
                klog.event("environment_pruned", caches=len(removed))
        async with anyio.create_task_group() as tg:  # each sleep's dispatch or wake on its own
            for sleep in sorted(b.waiters):
                got = self._waiting.get(sleep)
                if got is None:
                    continue
                got.keys.discard(key)
                if error is not None:
                    got.state = "failed"
                    tg.start_soon(self.on_failed, sleep, error)
                elif not got.keys:
                    got.state = "ready"
                    tg.start_soon(self.on_ready, sleep)


def _last_lines(data: bytes, lines: int) -> str:
    text = envcache.tail(data.decode("utf-8", "replace"), LOG_TAIL_BYTES)
    return "\n".join(text.splitlines()[-lines:])
