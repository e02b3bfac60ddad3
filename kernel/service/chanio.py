"""Channel I/O off the store worker: bounded threads, one call at a time per workspace, fair, with a deadline.

Every read or write of a workspace's channel that the request path makes (opening and checking it, listing and
reading `requests/`, ageing temps, writing answers and `budget.json`, removing answered requests) runs here and
never on the store worker, which keeps sqlite alone. So a workspace whose channel is slow (a listing of 100,000
names) or hung (a network filesystem that stopped answering) delays that workspace only.

Invariants, and why they hold:
- A workspace has at most one call running: its turn is taken before a slot is asked for, and held until the call
  returns (even past its deadline), so nothing more is started for a workspace whose I/O has not returned. Turns
  are handed on in arrival order; `begin` takes one only when nobody holds or waits for it, and a slot only when
  one is free (then nobody waits for a slot), so it passes no one.
- At most `size` calls hold a slot, and slots are granted first come first served (anyio's Semaphore wakes its
  waiters in order); since a workspace holds at most one place in the slot queue, every workspace gets a turn.
- A call still in channel I/O `deadline` seconds after it started (time inside `store_step()` does not count: a
  busy store is not a hung channel) is *overdue*: `on_overdue(key, since)` is awaited once,
  and the call gives its slot back (its thread stays blocked in the kernel until the filesystem answers), so the
  other workspaces keep every slot. At most OVERDUE_MAX calls give their slot back; past that (a whole filesystem
  hung) the slots stay held and the pool shrinks rather than growing threads without bound. When an overdue call
  returns, `on_returned(key)` is awaited before its caller goes on.
- With `finish_started` (the heavy pool: a started copy finishes), a caller cancelled while its call runs waits
  for it to return, as `anyio.to_thread.run_sync` does; a call past its deadline is still given up by `stop()`.
- Threads are daemon threads: a call that never returns cannot keep the process from exiting. While the pool is
  stopping, an overdue call (and whatever waits behind it for the same workspace) is abandoned: its caller gets
  ChannelIOAbandoned; exactly-once does not depend on it, since every answer is recorded before it is written and
  a request is removed only after its answer is in place (the next start replays the stored answer).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import anyio
import anyio.lowlevel

from kernel.io.loopcall import call_soon

T = TypeVar("T")

CHANNEL_IO_SLOTS: Final = 8
OVERDUE_MAX: Final = 64


@dataclass(slots=True)
class _Progress:
    """Where a call is: in channel I/O since `io_since`, or waiting for (or in) a store step."""

    io_since: float
    in_store: bool = False


@dataclass(slots=True)
class _Waiter:
    """A caller waiting for its workspace's turn; `granted` once the turn is handed to it."""

    given: anyio.Event
    granted: bool = False


@dataclass(slots=True)
class _Call:
    """One call submitted to a pool thread: its result (`box`, filled on the thread), `done` once the loop has
    seen it return, whether it still holds its slot (`held`) and whether its waiter took the result (`taken`)."""

    done: anyio.Event
    progress: _Progress
    box: list[tuple[bool, Any]] = field(default_factory=list)
    held: bool = True
    taken: bool = False


@dataclass(frozen=True, slots=True)
class Started(Generic[T]):
    """A call `ChannelIO.begin` started: pass it to `ChannelIO.finish`."""

    key: str
    call: _Call


_current = threading.local()


@contextlib.contextmanager
def store_step() -> Iterator[None]:
    """Around a store step made inside a pool call: the deadline does not run meanwhile (a busy store is not a
    hung channel), and the channel I/O after it is timed afresh."""
    progress: _Progress | None = getattr(_current, "progress", None)
    if progress is None:
        yield
        return
    progress.in_store = True
    try:
        yield
    finally:
        progress.io_since = time.time()
        progress.in_store = False


def timed_afresh() -> None:
    """Inside a pool call that works through several channels in turn (the start-up admission): the channel it
    turns to now is timed afresh, so the deadline is per channel, not per call."""
    progress: _Progress | None = getattr(_current, "progress", None)
    if progress is not None:
        progress.io_since = time.time()


class ChannelIOAbandoned(Exception):
    """The kernel is stopping and this workspace's channel I/O is overdue: the call was left to its thread."""


async def _nothing(key: str, *args: object) -> None:
    return None


class ChannelIO:
    def __init__(
        self,
        deadline: float | Callable[[], float],
        *,
        size: int = CHANNEL_IO_SLOTS,
        on_overdue: Callable[[str, float], Awaitable[None]] = _nothing,
        on_returned: Callable[[str], Awaitable[None]] = _nothing,
        clock: Callable[[], float] = time.time,
        finish_started: bool = False,
        thread_name: str = "channel-io",
    ) -> None:
        # A number, or where to read it at each use (the live config's deadline, kernel.service.reload).
        self._deadline = deadline if callable(deadline) else (lambda: deadline)
        self.finish_started = finish_started
        self.thread_name = thread_name
        self.on_overdue = on_overdue
        self.on_returned = on_returned
        self.clock = clock
        # fast_acquire: a free slot is taken without a trip round the event loop (a turn is visible latency);
        # fairness does not depend on that trip, since every caller then waits for its thread.
        self._slots = anyio.Semaphore(size, fast_acquire=True)
        # key -> the callers waiting for the workspace's turn, in arrival order; a key is present while a call
        # of that workspace holds its turn (from the moment the turn is taken until the call has returned).
        self._turns: dict[str, deque[_Waiter]] = {}
        # key -> when its overdue call started (clock time)
        self.overdue: dict[str, float] = {}
        self._stopping = False
        # The cancel scopes of callers (running or waiting for their workspace's turn), per workspace, so a
        # stop can abandon those of an overdue workspace.
        self._scopes: dict[str, set[anyio.CancelScope]] = {}
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._threads = 0
        self._mutex = threading.Lock()

    @property
    def deadline(self) -> float:
        """Seconds a call may spend in channel I/O before it is overdue, read afresh at each check: a call that
        starts after a change gets the new deadline, one already waiting is held to it at its next check (at the
        latest when its old deadline passes)."""
        return self._deadline()

    @property
    def workspaces(self) -> int:
        """How many workspaces have channel I/O running or waiting."""
        return len(self._turns)

    def running(self, key: str) -> bool:
        return key in self._turns

    def stop(self) -> None:
        """From now on an overdue call is abandoned (its caller gets ChannelIOAbandoned) instead of waited for."""
        self._stopping = True
        for key in list(self.overdue):
            self._abandon(key)

    def _abandon(self, key: str) -> None:
        for scope in self._scopes.get(key, ()):
            scope.cancel()

    # --- a workspace's turn (event loop only: no lock needed) -------------------------------------------------

    async def _take_turn(self, key: str) -> None:
        waiters = self._turns.get(key)
        if waiters is None:
            self._turns[key] = deque()
            return
        me = _Waiter(anyio.Event())
        waiters.append(me)
        try:
            await me.given.wait()
        except BaseException:
            if me.granted:
                self._pass_turn(key)  # given to us as we were cancelled: hand it on
            else:
                waiters.remove(me)
            raise

    def _pass_turn(self, key: str) -> None:
        waiters = self._turns[key]
        if waiters:
            nxt = waiters.popleft()
            nxt.granted = True
            nxt.given.set()
        else:
            del self._turns[key]

    # --- calls ----------------------------------------------------------------------------------------------

    async def run(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a pool thread, in `key`'s turn."""
        if self._stopping and key in self.overdue:
            raise ChannelIOAbandoned(key)
        scope = anyio.CancelScope()
        self._scopes.setdefault(key, set()).add(scope)
        try:
            with scope:
                await self._take_turn(key)
                try:
                    await self._slots.acquire()
                    call, job = self._prepare(fn, args)
                    self._submit(job)
                    return await self._wait(key, call)  # type: ignore[no-any-return]
                finally:
                    self._pass_turn(key)
            raise ChannelIOAbandoned(key)
        finally:
            self._forget_scope(key, scope)

    def can_begin(self, key: str) -> bool:
        """Whether `begin(key, ...)` would start a call now."""
        return not self._stopping and key not in self._turns and self._slots.value > 0

    def begin(
        self, key: str, fn: Callable[..., T], *args: Any, waiter: Callable[[Started[T]], object]
    ) -> bool:
        """From the event loop, without awaiting: if `key` has no call running or waiting and a slot is free (no
        caller waits for one: nobody is passed), take both, hand the call to `waiter` (which starts the task that
        awaits `finish()` on it), then start `fn(*args)` on a pool thread, and return True; else False and nothing
        is done. The thread is started last, so that the loop has nothing left to do but return when it wants
        the GIL (the caller spares the loop iterations of starting a task first)."""
        if not self.can_begin(key):
            return False
        self._slots.acquire_nowait()
        self._turns[key] = deque()
        call, job = self._prepare(fn, args)
        try:
            waiter(Started(key, call))
        except BaseException:
            self._slots.release()
            self._pass_turn(key)
            raise
        self._submit(job)
        return True

    async def finish(self, started: Started[T]) -> T:
        """What the call `begin()` started returned (or raised), with the deadline and overdue rules of `run`."""
        key = started.key
        scope = anyio.CancelScope()
        self._scopes.setdefault(key, set()).add(scope)
        try:
            with scope:
                try:
                    return await self._wait(key, started.call)  # type: ignore[no-any-return]
                finally:
                    self._pass_turn(key)
            raise ChannelIOAbandoned(key)
        finally:
            self._forget_scope(key, scope)

    def _forget_scope(self, key: str, scope: anyio.CancelScope) -> None:
        self._scopes[key].discard(scope)
        if not self._scopes[key]:
            del self._scopes[key]

    def _prepare(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[_Call, Callable[[], None]]:
        """The call of `fn(*args)` and the job that makes it on a pool thread (`_submit`); the caller holds the
        workspace's turn and one slot, which the call owns from then on (`_wait` or, if its waiter was cancelled,
        `finished` gives the slot back)."""
        call = _Call(anyio.Event(), progress=_Progress(self.clock()))
        token = anyio.lowlevel.current_token()

        def finished() -> None:
            call.done.set()
            if call.held and not call.taken:
                # The caller was cancelled (stopping) before the call returned: the slot is given back here.
                call.held = False
                self._slots.release()

        def job() -> None:
            _current.progress = call.progress
            try:
                call.box.append((True, fn(*args)))
            except BaseException as exc:
                call.box.append((False, exc))
            finally:
                _current.progress = None
            with contextlib.suppress(RuntimeError):  # the loop is gone (the process is exiting)
                call_soon(token, finished)

        return call, job

    async def _wait(self, key: str, call: _Call) -> Any:
        done, progress = call.done, call.progress
        was_overdue = False
        # With `finish_started` the wait is shielded from the caller's cancellation; it is registered with the
        # caller's scopes so that `stop()` can still give up an overdue call.
        waiting = anyio.CancelScope(shield=self.finish_started)
        if self.finish_started:
            self._scopes[key].add(waiting)
        try:
            with waiting:
                wait = self.deadline
                while True:
                    with anyio.move_on_after(wait):
                        await done.wait()
                    if done.is_set():
                        break
                    # Past the deadline only in channel I/O: time spent on a store step does not count.
                    out_for = self.clock() - progress.io_since
                    deadline = self.deadline
                    if progress.in_store or out_for < deadline:
                        wait = deadline if progress.in_store else deadline - out_for
                        continue
                    break
                if not done.is_set():
                    was_overdue = True
                    started = progress.io_since
                    self.overdue[key] = started
                    if len(self.overdue) <= OVERDUE_MAX:
                        call.held = False
                        self._slots.release()
                    await self.on_overdue(key, started)
                    if self._stopping:
                        self._abandon(key)
                    await done.wait()
        finally:
            self._scopes[key].discard(waiting)
            if done.is_set():
                call.taken = True
                if call.held:
                    call.held = False
                    self._slots.release()
        if not done.is_set():  # `stop()` gave up this overdue call (its shielded wait was cancelled)
            raise ChannelIOAbandoned(key)
        if was_overdue:
            del self.overdue[key]
            with anyio.CancelScope(shield=True):
                await self.on_returned(key)
        ok, value = call.box[0]
        if not ok:
            raise value
        return value

    # --- the threads (daemon: a call that never returns cannot hold the process at exit) ---------------------

    def _submit(self, job: Callable[[], None]) -> None:
        with self._mutex:
            start = self._idle == 0
            if start:
                self._threads += 1
            else:
                self._idle -= 1
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._work, name=self.thread_name, daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            job()
            with self._mutex:
                self._idle += 1
