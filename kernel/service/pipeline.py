"""The request pipeline: channel file -> decode -> decide -> record -> answer, exactly once per request.

For each request: read it through `safefs` (a FIFO, symlink, hardlink or oversized file is refused and answered
`rejected`), hash it, and look the (workspace, id) up in the store. A known id with the same bytes gets its stored
answer again; with other bytes it is refused (`request.id.reused`). A new request is decoded, decided by the pure
rules in `kernel.core.rules`, and recorded together with its answer in ONE transaction, committed before the answer
file is written and the request file removed. A kernel killed anywhere in between finds the request again and
replays the stored answer, so every request is answered exactly once.

Sleeps and cancels go further: the transaction records the request without an answer (plus the sleep, its
PENDING tasks and the charge, or the cancel's refunds); after the commit the executor is called
(`kernel.service.executor`), and only then is the answer recorded and written. Such an unanswered request is resumed at
start (`recover`) or when its file is seen again.

Work is bounded: each pass serves at most `batch_per_workspace` requests of one workspace and
`batch_per_pass` in all, round-robin (`rules.plan_pass`), and a channel's listing is reused until its backlog
is drained, so a channel holding 10,000 requests costs one listing per 10,000 answers and never starves others.
Temp files a client abandoned (`.<id>.tmp` unchanged for `temp_grace_minutes`) are aged out the same bounded
way, a few hundred per listing, resuming where the previous listing stopped.

Who runs what: a pass starts one *turn* per planned workspace, as a task, and does not wait for it. A turn is
one call in the channel I/O pool (`kernel.service.chanio`: bounded, one call per workspace at a time, fair, with a
deadline): open and check the channel, list it or take the names events gave, read the requests; then its sqlite
step (look-ups, the pure decision in `kernel.core.rules`, the recording transaction) under the store worker's lock
(`StoreWorker.run_here`: one writer at a time, and no extra hops through the event loop); then write the answers
and the budget and remove the requests. A `tail` ends the sqlite step at it: its task's run directory is read in
the same pool call, then a second step records its answer and decides the rest. A store step uses sqlite only
(the tests fail any other file call in one: kernel.io.stepguard), so a workspace whose channel or run directory
is slow or hung delays nobody else: past `channel_io_deadline_seconds` of channel I/O (time spent waiting for
the store does not count) its problem shows in `syscall-kernel status`, nothing more is started for it until the
I/O returns, and other workspaces are served.

The pipeline keeps no workspace's problem: it tells its owner what each turn found through `PipelineHooks` (the
channel opened and checked, could not be opened or read, its I/O overdue or returned), and the serve core
(kernel.core.serving) decides what the workspace shows, logs it once and has the service write it.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

import anyio

from channel import limits as L
from channel import safefs
from channel.decode import RequestError, check_policy, decode_request, parse_request, rejected
from channel.lifecycle import SleepEvent, TaskEvent, next_sleep_state
from channel.messages import (
    Accepted,
    Answer,
    Cancelled,
    CancelRequest,
    HistoryAnswer,
    HistoryRequest,
    JobRef,
    QueueAnswer,
    QueueRequest,
    Rejected,
    SleepRequest,
    StatusAnswer,
    StatusRequest,
    TailAnswer,
    TailRequest,
    encode,
)
from channel.paths import ChannelPaths, RunPaths
from kernel.core import ledger, rules
from kernel.core.budget import Balance
from kernel.core.config import Config, LiveConfig
from kernel.core.records import JobRow, RequestRow, SleepRow, WorkspaceRow
from kernel.io import crash, metrics
from kernel.io.enroll import OwnedElsewhere, kernel_ref, owner_of, write_budget
from kernel.io.log import event
from kernel.io.store import StoreUnavailable, StoreWorker, timestamp
from kernel.service import gather, telling
from kernel.service.chanio import ChannelIO, ChannelIOAbandoned, Started, store_step
from kernel.service.executor import DispatchRefused, Executor, ExecutorUnavailable, SleepOrder
from kernel.service.watching import channel_problem

# Listings of a rescan or poll tick in flight at once (on top of the channels with news), so that a sweep of
# 1,000 quiet channels never fills the channel I/O queue in front of a request an event announced.
SWEEP_IN_FLIGHT: Final = 4
# Junk names (not `<id>.json`, not a temp file) removed per listing; the rest go at the next listing.
JUNK_PER_LISTING: Final = 256
# Temp names examined (lstat, and removed if stale) per listing; the rest go at the next listing.
TEMPS_PER_LISTING: Final = 256
# A workspace whose executor call failed for the world's reasons (`ExecutorUnavailable`: fork failing at the
# process limit, a full disk, the scheduler unreachable) is retried after RETRY_BASE_S, doubling per failure up to
# RETRY_CAP_S; meanwhile its other requests are answered as usual.
RETRY_BASE_S: Final = 1.0
RETRY_CAP_S: Final = 300.0


@dataclass(slots=True)
class _Backoff:
    failures: int
    until: float  # on the service's clock (`PipelineHooks.plan_clock`)
    error: str


Spawn = Callable[["Continuation"], object]
T = TypeVar("T")
A = TypeVar("A", bound=Answer)


@dataclass(frozen=True, slots=True)
class _Turn:
    """What one turn does for a workspace: list in full, take the names events gave, or go on with its
    backlog; then read up to `n` requests."""

    key: str
    n: int
    full: bool
    names: set[str] | None
    swept: bool
    check_owner: bool = False
    planned: float = 0.0  # the service's clock when the turn was planned (before its listing began)


@dataclass(frozen=True, slots=True)
class _Read:
    """One request as read from the channel (or why it could not be read)."""

    rid: str
    received: float
    data: bytes = b""
    inode: safefs.Inode | None = None
    refused: str | None = None


@dataclass(frozen=True, slots=True)
class _Taken:
    ch: safefs.Channel
    reads: list[_Read]
    relist: bool  # more junk or stale temps left than one listing takes: list again at once


@dataclass(frozen=True, slots=True)
class _Delivery:
    """A recorded answer to write, and the request file (the inode read) to remove once it is in place."""

    rid: str
    answer: bytes
    outcome: str
    received: float
    only: safefs.Inode | None


@dataclass(slots=True)
class _Recorded:
    """What a turn's store step decided: answers to deliver, a new budget to publish, the continuation that
    goes on to the executor, and the ids read after it (read again once the executor is done)."""

    deliveries: list[_Delivery] = field(default_factory=list)
    # A read-only answer was recorded without the WAL's fsync: the store is synced before any request is removed.
    unsynced: bool = False
    budget: tuple[Balance, str, int] | None = None  # the balance, when, its stamp (kernel.io.budgetorder)
    cont: Continuation | None = None
    left: list[str] = field(default_factory=list)
    # A new `tail` whose task was found: the step ends at it, its run directory is read outside the store's lock,
    # and the next step records its answer and decides `rest`, the reads after it.
    look: _TailLook | None = None
    rest: list[_Read] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _TailLook:
    """A `tail` as the store answers it: the sleep and the task it names (`rules.tail_target`)."""

    read: _Read
    digest: str
    req: TailRequest
    sleep_id: str
    job: JobRow
    # A PENDING task's sleep waits for its environment build: the build's log so far (text, size, cut), from the
    # executor's memory; then no run directory is read.
    building: tuple[str, int, bool] | None = None


@dataclass(frozen=True, slots=True)
class _TailSeen:
    """What a `tail` found in its task's run directory: the log so far, and whether the task has started."""

    live: gather.LiveTail
    started: bool


@dataclass(frozen=True, slots=True)
class _TurnDone:
    relist: bool
    handled: int = 0
    answered: int = 0
    cont: Continuation | None = None
    left: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Begun:
    """A turn whose channel I/O `start_now` started before its task ran."""

    ws: WorkspaceRow
    started: Started[_TurnDone]


@dataclass(frozen=True, slots=True)
class _Answered:
    ws: WorkspaceRow
    answer: bytes
    outcome: str
    stamp: int  # of the store step that read `ws` (kernel.io.budgetorder)


@dataclass(frozen=True, slots=True)
class Continuation:
    """A recorded sleep or cancel waiting for the executor, then for its answer."""

    kind: str  # "sleep" | "cancel"
    key: str
    request_id: str
    seq: int
    names: tuple[str, ...] = ()
    received: float = 0.0


async def _ignore_owner(ws: WorkspaceRow, exc: OwnedElsewhere) -> None:
    return None


def _nothing(*args: object) -> None:
    return None


@dataclass(frozen=True, slots=True)
class PipelineHooks:
    """What the pipeline tells its owner (the service), each called on the event loop. The workspaces' problems
    are not the pipeline's: it says what its turns found (`ok`, `failed`, `overdue`, `returned`) and the serve
    core (kernel.core.serving) decides what each workspace shows."""

    # A continuation ended for this workspace (its waiting requests may be served now).
    idle: Callable[[str], None] = _nothing
    # A turn ended (the service loop plans the next pass).
    turn_done: Callable[[], None] = _nothing
    # A full listing of the workspace, planned at the time given (on `plan_clock`: the service's clock), completed,
    # with its owner read or not / the turn answered requests (the poll schedule, the rescan's ledger:
    # kernel.core.polling).
    listed: Callable[[str, float, bool], None] = _nothing
    plan_clock: Callable[[], float] = time.monotonic
    answered: Callable[[str], None] = _nothing
    # A turn found the channel's kernel.json naming another store (the rescan's owner check).
    owned_elsewhere: Callable[[WorkspaceRow, OwnedElsewhere], Awaitable[None]] = _ignore_owner
    # This kernel's store id (None until known: the rescan checks no owner until then).
    store_id: Callable[[], str | None] = lambda: None
    # A served workspace's turn opened and checked its channel / a turn or an answer's delivery could not open or
    # read it (why) / its channel I/O is overdue (since, the deadline in seconds) / that I/O returned.
    ok: Callable[[str], None] = _nothing
    failed: Callable[[str, str], None] = _nothing
    overdue: Callable[[str, float, float], None] = _nothing
    returned: Callable[[str], None] = _nothing


class Pipeline:
    def __init__(
        self,
        live: LiveConfig,
        worker: StoreWorker,
        executor: Executor,
        *,
        clock: Callable[[], float] = time.time,
        hooks: PipelineHooks | None = None,
    ) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.executor = executor
        self.clock = clock
        self.hooks = PipelineHooks() if hooks is None else hooks
        self.kernel = kernel_ref()
        self.workspaces: dict[str, WorkspaceRow] = {}
        self.backlog: dict[str, deque[str]] = {}
        self.dirty: set[str] = set()
        self.named: dict[str, set[str]] = {}  # request file names events announced (see `mark`)
        self._sweep: deque[str] = deque()
        # Workspaces with a continuation at the executor; `hooks.idle(key)` is called when it is done.
        self.busy: set[str] = set()
        self._swept: set[str] = set()
        self._stuck: dict[str, set[str]] = {}
        # (workspace, request id) -> the inode its request was read from, until the answer is delivered.
        self._read_as: dict[tuple[str, str], safefs.Inode] = {}
        # Per workspace, requests whose answer could not be written (kept, retried at every listing).
        self._backoff: dict[str, _Backoff] = {}
        self._blocked: dict[str, set[str]] = {}
        # Per workspace, the last temp name examined: the next listing goes on after it (wrapping around).
        self._temp_cursor: dict[str, str] = {}
        self._after: str | None = None
        # Workspaces with a turn in flight (one at a time each), and how many of those the sweep started.
        self.inflight: set[str] = set()
        self._sweeping = 0
        # A turn's store step failed (the disk): raised to the service loop (`take_store_failure`), which waits
        # and sweeps again.
        self._store_failed: StoreUnavailable | None = None
        self.chanio = ChannelIO(
            lambda: self.cfg.channel_io_deadline_seconds,
            on_overdue=self._io_overdue,
            on_returned=self._io_returned,
        )
        # The rescan's owner check (kernel.json may name another kernel's store: a take-over), made by the next
        # turn of each workspace in the channel I/O pool; `hooks.owned_elsewhere` tells the service.
        self._owner_due: set[str] = set()
        # When the store step now running started (the watchdog: a step that never ends stops the pings).
        self.pass_started: float | None = None
        self.answered = 0
        self.last_pass_ms = 0.0

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    # --- scheduling ---------------------------------------------------------------------------------------

    def set_workspaces(self, rows: list[WorkspaceRow]) -> None:
        """Serve `rows` (and no other workspace): what is kept of a workspace no longer served goes."""
        self.workspaces = {r.key: r for r in rows}
        for key in list(self.backlog):
            if key not in self.workspaces:
                del self.backlog[key]
        for per_ws in (self._temp_cursor, self._blocked, self._backoff):
            for key in list(per_ws):
                if key not in self.workspaces:
                    del per_ws[key]
        self.dirty &= set(self.workspaces)
        for key in list(self.named):
            if key not in self.workspaces:
                del self.named[key]

    def keep_only(self, enrolled: set[str]) -> None:
        """Forget what is kept of the workspaces not `enrolled` (any more): the requests it could not remove, the
        inodes read of requests at the executor, the owner checks due."""
        for key in [k for k in self._stuck if k not in enrolled]:
            del self._stuck[key]
        for pair in [p for p in self._read_as if p[0] not in enrolled]:
            self._read_as.pop(pair, None)
        self._owner_due &= enrolled

    def take_store_failure(self) -> StoreUnavailable | None:
        """The failure of a turn's store step since the last call (the disk), now taken; None: none."""
        failed, self._store_failed = self._store_failed, None
        return failed

    def mark(self, key: str, names: Iterable[str] | None = None) -> None:
        """A watcher event: the channel has news. With the `names` the events carried, only those are read in the
        next pass (a channel holding 100,000 temp names is not listed for one request); without, the whole
        `requests/` is listed. The rescan and the poll list in full, as ground truth."""
        if key not in self.workspaces:
            return
        if names is None:
            self.dirty.add(key)
        else:
            self.named.setdefault(key, set()).update(names)

    def sweep(self, keys: Iterable[str] | None = None, *, owners: bool = False) -> None:
        """Rescan (all keys) or poll tick: list these channels, a few per pass, behind the channels with news,
        so that a sweep of 1,000 quiet channels never sits in front of one request that an event announced.
        With `owners` (the rescan) each channel's next turn also checks the owner its kernel.json names."""
        if owners and self.hooks.store_id() is not None:
            self._owner_due.update(self.workspaces if keys is None else keys)
        for key in self.workspaces if keys is None else keys:
            if key in self.workspaces and key not in self._swept:
                self._swept.add(key)
                self._sweep.append(key)

    def sweeping(self) -> bool:
        """Whether channels of a rescan or poll tick wait to be listed."""
        return bool(self._sweep)

    def has_work(self) -> bool:
        """Whether a pass would start anything now (workspaces with a turn in flight wait for it to end). Called
        at every turn of the service loop: it stops at the first workspace that can go on, so it costs the
        workspaces with news that wait (at most those in flight or at the executor), never all of them."""
        if self._sweep and self._sweeping < SWEEP_IN_FLIGHT:
            return True
        busy, inflight = self.busy, self.inflight
        for k in self.dirty:
            if k not in busy and k not in inflight:
                return True
        for k in self.named:
            if k not in busy and k not in inflight:
                return True
        # A copy first (see `_pending`).
        return any(q and k not in busy and k not in inflight for k, q in list(self.backlog.items()))

    def _pending(self) -> dict[str, int]:
        # A workspace with a sleep or cancel at the executor waits (its next request may depend on it), as does
        # one whose turn is still in flight (its channel I/O may not have returned); the others go on.
        busy, inflight = self.busy, self.inflight
        # A copy first: channel I/O threads add keys to `backlog` (`_take`) while this runs on the loop, and a
        # dict that grows during iteration raises (seen at 10,000 workspaces); list() copies it in one C call.
        pending = {
            k: len(q) for k, q in list(self.backlog.items()) if q and k not in busy and k not in inflight
        }
        if self.dirty or self.named:
            n = self.cfg.batch_per_workspace
            for k in (*self.dirty, *self.named):
                if k not in busy and k not in inflight:
                    pending.setdefault(k, n)
        return pending

    def _plan(self) -> list[_Turn]:
        """The turns of one bounded, fair pass (rules.plan_pass round-robin), plus a few channels of the sweep
        (at most SWEEP_IN_FLIGHT listings of the sweep in flight, so a sweep of 1,000 quiet channels never
        fills the channel I/O queue in front of a request an event announced)."""
        plan, self._after = rules.plan_pass(
            self._pending(), self._after, self.cfg.batch_per_workspace, self.cfg.batch_per_pass
        )
        turns: list[_Turn] = []
        for key, n in plan:
            turns.append(self._turn_of(key, n, swept=False))
        planned = {k for k, _ in plan}
        while self._sweep and self._sweeping < SWEEP_IN_FLIGHT:
            key = self._sweep.popleft()
            self._swept.discard(key)
            if key not in self.workspaces or key in planned or key in self.busy or self.backlog.get(key):
                continue
            if key in self.inflight:
                self.dirty.add(key)  # listed in full once its turn in flight ends
                continue
            self.dirty.add(key)
            turns.append(self._turn_of(key, self.cfg.batch_per_workspace, swept=True))
            self._sweeping += 1
        return turns

    def _turn_of(self, key: str, n: int, *, swept: bool) -> _Turn:
        # Decided here, on the event loop (where `mark` runs), so an event that arrives while the turn's
        # channel I/O runs is kept for the next turn, never lost.
        self.inflight.add(key)
        owner = key in self._owner_due
        self._owner_due.discard(key)
        queue = self.backlog.get(key)
        if not queue and key in self.dirty:
            self.dirty.discard(key)
            self.named.pop(key, None)  # the full listing sees them too
            return _Turn(key, n, True, None, swept, owner, self.hooks.plan_clock())
        if not queue and key in self.named:
            return _Turn(key, n, False, self.named.pop(key), swept, owner)
        return _Turn(key, n, False, None, swept, owner)

    def start_pass(self, start: Callable[..., object], spawn: Spawn | None = None) -> int:
        """Start one pass's turns as tasks (`start` is a task group's `start_soon`) and return at once: the
        service loop never waits for a workspace's channel I/O. Each turn ends with `hooks.turn_done()`."""
        turns = self._plan()
        for t in turns:
            start(self._run_turn, t, spawn)
        return len(turns)

    def start_now(self, key: str, start: Callable[..., object], spawn: Spawn | None = None) -> bool:
        """Start `key`'s turn now, its channel I/O already on a pool thread when this returns, if it has news, no
        turn in flight, no continuation at the executor and a free slot of the channel I/O pool (so it passes no
        one); False, and nothing changed, otherwise. The service loop calls this for the workspace an event
        names while it is idle: the turn's thread starts without waiting for a pass or for the turn's task."""
        ws = self.workspaces.get(key)
        if (
            ws is None
            or key in self.inflight
            or key in self.busy
            or not (self.backlog.get(key) or key in self.dirty or key in self.named)
            or not self.chanio.can_begin(key)
        ):
            return False
        t = self._turn_of(key, self.cfg.batch_per_workspace, swept=False)
        begun = self.chanio.begin(
            key, self._whole_turn, ws, t, waiter=lambda s: start(self._run_turn, t, spawn, _Begun(ws, s))
        )
        assert begun  # can_begin said so, and nothing ran in between (one thread: the loop's)
        return True

    async def run_pass(self, spawn: Spawn | None = None) -> int:
        """Serve one bounded, fair pass and wait for all of its turns; return how many requests were handled.

        Sleeps and cancels recorded in the pass continue at the executor through `spawn` (a task in the
        service's task group), so a slow snapshot or submission never holds up other workspaces; without
        `spawn` they are awaited here.
        """
        handled = 0

        async def one(t: _Turn) -> None:
            nonlocal handled
            handled += await self._run_turn(t, spawn)

        async with anyio.create_task_group() as tg:
            for t in self._plan():
                tg.start_soon(one, t)
        failed = self.take_store_failure()
        if failed is not None:
            raise failed
        return handled

    async def _start(self, c: Continuation, spawn: Spawn | None) -> None:
        self.busy.add(c.key)
        if spawn is None:
            await self.advance(c)
        else:
            spawn(c)

    # --- a workspace's turn: channel I/O (pool), decisions and records (store worker), answers (pool) -------

    async def _run_turn(self, t: _Turn, spawn: Spawn | None, begun: _Begun | None = None) -> int:
        started = self.clock()
        try:
            return await self._turn(t, spawn, begun)
        except ChannelIOAbandoned:
            return 0  # stopping; its requests stay in the channel for the next start
        except StoreUnavailable as exc:
            # Logged by the worker. What was committed is replayed from the store at the next listing; the
            # service loop waits and sweeps again (the requests stay in their channel).
            self.backlog.pop(t.key, None)
            self._store_failed = exc
            return 0
        finally:
            if not self.backlog.get(t.key):
                # Only workspaces with a backlog stay in it: planning a pass (`_pending`) walks it on the loop,
                # and at 10,000 workspaces an entry for every channel ever listed made each loop turn O(N).
                self.backlog.pop(t.key, None)
            self.inflight.discard(t.key)
            if t.swept:
                self._sweeping -= 1
            self.last_pass_ms = (self.clock() - started) * 1000
            metrics.PASS_SECONDS.observe(self.last_pass_ms / 1000)
            self.hooks.turn_done()

    async def _turn(self, t: _Turn, spawn: Spawn | None, begun: _Begun | None) -> int:
        """The workspace's turn, one call in the channel I/O pool (`_whole_turn`; already started if `begun`);
        what it found is applied here, on the loop (relisting, the ids left for later, the continuation)."""
        ws = begun.ws if begun is not None else self.workspaces.get(t.key)
        if ws is None:
            self.dirty.discard(t.key)
            return 0
        try:
            if begun is not None:
                done = await self.chanio.finish(begun.started)
            else:
                done = await self.chanio.run(t.key, self._whole_turn, ws, t)
        except OwnedElsewhere as exc:
            # Taken over by another kernel's store: its requests are that kernel's; nothing read is answered.
            self.backlog.pop(t.key, None)
            await self.hooks.owned_elsewhere(ws, exc)
            return 0
        except (safefs.ChannelMoved, safefs.Refused, OSError) as exc:
            self.backlog.pop(t.key, None)
            self.dirty.discard(t.key)
            self.named.pop(t.key, None)
            self._failed_io(t.key, exc)
            return 0
        if t.key in self.workspaces:
            self.hooks.ok(t.key)
        if t.full:
            self.hooks.listed(t.key, t.planned, t.check_owner)
        if done.answered:
            self.hooks.answered(t.key)
        if done.relist:
            self.dirty.add(t.key)
        if done.left:
            self.backlog.setdefault(t.key, deque()).extendleft(reversed(done.left))
        self.answered += done.answered
        if done.cont is not None:
            # The workspace's later requests wait until the executor is done with this one.
            await self._start(done.cont, spawn)
        return done.handled

    def _whole_turn(self, ws: WorkspaceRow, t: _Turn) -> _TurnDone:
        """One pool call (two thread hops, as when the store worker did it all): read, then the store step
        under the store worker's lock (`run_here`; the deadline pauses meanwhile), then deliver. A `tail` splits
        the store step in two: its task's run directory is read between them, here, never under the lock (on
        Slurm it is a shared filesystem that can hang). Every answer is committed before its file is written and
        its request removed, so a kill anywhere in between replays the stored answer (exactly once)."""
        taken = self._take(ws, t)
        try:
            if not taken.reads:
                return _TurnDone(taken.relist)
            with store_step():
                rec = self.worker.run_here(self._timed, self._record, ws, taken.reads, _Recorded())
            while rec.look is not None:
                # The run directory: in this call, so in its deadline, and outside the store's lock.
                seen = _look_at(rec.look)
                with store_step():
                    rec = self.worker.run_here(self._timed, self._record_tail, ws, seen, rec)
            answered = 0
            if rec.deliveries or rec.budget is not None:
                answered = self._deliver_all(ws, taken.ch, rec)
            return _TurnDone(taken.relist, len(taken.reads) - len(rec.left), answered, rec.cont, rec.left)
        finally:
            taken.ch.close()

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        # On the store worker (one step at a time): the watchdog's view of a store step that does not end.
        self.pass_started = self.clock()
        try:
            return fn(*args)
        finally:
            self.pass_started = None

    # --- channel I/O (pool threads; one call per workspace at a time, so a workspace's backlog, temp cursor,
    # blocked and stuck sets are touched by one thread at a time) --------------------------------------------

    def _take(self, ws: WorkspaceRow, t: _Turn) -> _Taken:
        """Open and check the channel, list it (in full, or the names events gave) when its backlog is empty,
        and read up to `t.n` requests of the backlog."""
        crash.hang_point("channel", ws.path)
        ch = safefs.open_channel(ws.path, ws.identity)
        try:
            # A replaced subdirectory (spec 2.3) stops this workspace only: nothing is read from it or written
            # into it, its requests stay where they are, until `enroll` adopts it.
            ch.check_subdirs()
            if t.check_owner:
                found = owner_of(ch)
                if found is not None and found.store != self.hooks.store_id():
                    raise OwnedElsewhere(ws.path, found)
            queue = self.backlog.setdefault(ws.key, deque())
            relist = False
            if t.full:
                relist = self._list(ws, ch, queue)
            elif t.names is not None:
                relist = self._take_named(ws, t.names, queue)
            reads = []
            for _ in range(t.n):
                if not queue:
                    break
                reads.append(self._read(ch, queue.popleft()))
        except BaseException:
            ch.close()
            raise
        return _Taken(ch, reads, relist)

    def _read(self, ch: safefs.Channel, rid: str) -> _Read:
        received = self.clock()
        try:
            data, inode = ch.read_request_entry(rid)
        except safefs.Refused as exc:
            return _Read(rid, received, refused=exc.reason)
        return _Read(rid, received, data, inode)

    def _take_named(self, ws: WorkspaceRow, names: set[str], queue: deque[str]) -> bool:
        """Queue the committed requests events named (in name order, as a listing would); a junk name (not
        `<id>.json`) asks for a full listing (True), which removes it."""
        stuck = self._stuck.get(ws.key, set())
        ids = []
        relist = False
        for name in sorted(names):
            rid = ChannelPaths.committed_request_id(name)
            if rid is None:
                if not ChannelPaths.is_temp(name):
                    relist = True
            elif rid not in stuck:
                ids.append(rid)
        queue.extend(ids)
        return relist

    def _list(self, ws: WorkspaceRow, ch: safefs.Channel, queue: deque[str]) -> bool:
        """A full listing: queue the committed requests, remove junk and age temps (a bounded number each);
        True when more is left than one listing takes (list again at once)."""
        listing = ch.scan_requests()
        crash.hang_point("listing", ws.path)
        ids, junk = listing.ids, listing.junk
        stuck = self._stuck.get(ws.key)
        if stuck:
            stuck &= set(ids)
            ids = [i for i in ids if i not in stuck]
        queue.extend(ids)
        relist = False
        if junk:
            removed = 0
            for name in junk[:JUNK_PER_LISTING]:
                try:
                    ch.remove_request(name)
                    removed += 1
                except (safefs.Refused, OSError):
                    pass
            event("junk_removed", ws=ws.key, count=removed, first=junk[0])
            relist = len(junk) > JUNK_PER_LISTING
        if listing.temps:
            relist = self._age_out_temps(ws, ch, listing.temps) or relist
        return relist

    def _age_out_temps(self, ws: WorkspaceRow, ch: safefs.Channel, temps: list[str]) -> bool:
        """Remove up to TEMPS_PER_LISTING abandoned temps, starting after the last name examined.

        The channel is listed again at once (True) only while stale temps are being found; a batch of young
        ones waits for the next event or rescan, so a channel full of writes in progress is not re-listed every
        pass.
        """
        # The next TEMPS_PER_LISTING names after the cursor, in name order, wrapping around (selected, not
        # sorted: the listing leaves 100,000 temps unsorted).
        cursor = self._temp_cursor.get(ws.key, "")
        batch = heapq.nsmallest(TEMPS_PER_LISTING, [n for n in temps if n > cursor])
        if len(batch) < TEMPS_PER_LISTING:
            batch += heapq.nsmallest(TEMPS_PER_LISTING - len(batch), [n for n in temps if n <= cursor])
        self._temp_cursor[ws.key] = batch[-1]
        cutoff_ns = int((self.clock() - self.cfg.temp_grace_minutes * 60) * 1e9)
        swept = ch.remove_stale_temps(batch, cutoff_ns)
        if swept.removed:
            event("temps_removed", ws=ws.key, count=swept.removed, young=swept.young, left=swept.kept)
            return len(temps) > len(batch)
        return False

    def _deliver_all(self, ws: WorkspaceRow, ch: safefs.Channel, rec: _Recorded) -> int:
        """Write the recorded answers (in order), make the records of read-only answers durable, remove the
        answered requests, then write the new budget of a recorded sleep or cancel; how many requests were
        answered."""
        shown = [d for d in rec.deliveries if self._show(ch, ws, d)]
        if shown and rec.unsynced:
            with store_step():  # the kernel's own disk, not this channel: outside the channel I/O deadline
                self.store.sync_wal()
        for d in shown:
            self._remove(ch, ws, d)
        if rec.budget is not None:
            balance, now, stamp = rec.budget
            self.store.budget_order.write(ws.key, stamp, balance, lambda b: write_budget(ch, b, now))
        return len(shown)

    def _deliver_recorded(
        self, ws: WorkspaceRow, stamp: int, rid: str, answer: bytes, outcome: str, received: float
    ) -> int:
        """A continuation's answer (recorded): the budget as recorded (unless a newer one was written meanwhile:
        its jobs may have ended and been woken already), then the answer."""
        crash.hang_point("channel", ws.path)
        with safefs.open_channel(ws.path, ws.identity) as ch:
            now = timestamp(self.clock())
            self.store.budget_order.write(
                ws.key, stamp, ws.balance, lambda b: write_budget(ch, b, now, only_if_changed=True)
            )
            only = self._read_as.pop((ws.key, rid), None)
            return self._deliver(ch, ws, _Delivery(rid, answer, outcome, received, only))

    # --- the store part of a turn (store worker) ------------------------------------------------------------

    def _record(self, ws: WorkspaceRow, reads: list[_Read], rec: _Recorded) -> _Recorded:
        """Decide and record each request read, in order, into `rec`, up to the first that goes on to the
        executor (the rest are read again after it) or a new `tail` (`rec.look`; the rest are decided after it,
        in the step that records its answer)."""
        for i, r in enumerate(reads):
            self._decide(ws, r, rec)
            if rec.cont is not None:
                rec.left = [x.rid for x in reads[i + 1 :]]
                break
            if rec.look is not None:
                rec.rest = reads[i + 1 :]
                break
        return rec

    def _record_tail(self, ws: WorkspaceRow, seen: _TailSeen, rec: _Recorded) -> _Recorded:
        """Record the answer of the `tail` whose run directory was read (`seen`), then decide the reads after it."""
        look, rest = rec.look, rec.rest
        assert look is not None
        rec.look, rec.rest = None, []
        self._record_read_only(rec, ws, look.read, look.digest, "tail", _tail_answer(look, seen), "tail")
        return self._record(ws, rest, rec)

    def _failed_io(self, key: str, exc: Exception) -> None:
        """A turn or an answer's delivery could not open or read `key`'s channel: the service is told, while the
        workspace is served (its problem is the serve core's)."""
        if key in self.workspaces:
            self.hooks.failed(key, channel_problem(exc))

    async def _io_overdue(self, key: str, since: float) -> None:
        if key in self.workspaces:
            self.hooks.overdue(key, since, self.chanio.deadline)

    async def _io_returned(self, key: str) -> None:
        self.hooks.returned(key)

    def _deliver(self, ch: safefs.Channel, ws: WorkspaceRow, d: _Delivery) -> int:
        """Write the (recorded, durable) answer, then remove the request; 1 when answered."""
        if not self._show(ch, ws, d):
            return 0
        self._remove(ch, ws, d)
        return 1

    def _show(self, ch: safefs.Channel, ws: WorkspaceRow, d: _Delivery) -> bool:
        """Write the recorded answer; True once it is in place and durable. The request is removed only after
        that (spec 3.4): a write that fails or is refused keeps it, and the next listing of the channel (an
        event, the poll or the rescan) replays the recorded answer, so no answer is ever lost."""
        rid = d.rid
        try:
            # Shown before its fsyncs (the agent reads it a disk flush sooner) and durable before the request is
            # removed (spec 3.4): the answer is recorded already, so a power cut that tears the file leaves its
            # request in place, and the next start replays the recorded answer over it.
            ch.write_file(ChannelPaths.ANSWERS, ChannelPaths.answer(rid), d.answer, shown_first=True)
        except safefs.Refused as exc:
            # The agent blocked its own answer (`answers/` a symlink, a directory in the way): logged once.
            if rid not in self._blocked.setdefault(ws.key, set()):
                self._blocked[ws.key].add(rid)
                event("answer_blocked", logging.WARNING, ws=ws.key, id=rid, reason=exc.reason)
            return False
        except OSError as exc:
            event("answer_failed", logging.ERROR, ws=ws.key, id=rid, error=exc.strerror or str(exc))
            return False
        blocked = self._blocked.get(ws.key)
        if blocked and rid in blocked:
            blocked.discard(rid)
            event("answer_unblocked", ws=ws.key, id=rid)
        return True

    def _remove(self, ch: safefs.Channel, ws: WorkspaceRow, d: _Delivery) -> None:
        """Remove an answered request (its answer and record are durable) and count it."""
        rid = d.rid
        try:
            # Only the file that was read: a new request renamed over the name since then is kept.
            ch.remove_request(ChannelPaths.request(rid), only=d.only)
        except safefs.Refused:
            self._stuck.setdefault(ws.key, set()).add(rid)
        except OSError as exc:
            event("request_not_removed", logging.WARNING, ws=ws.key, id=rid, error=exc.strerror)
        ms = (self.clock() - d.received) * 1000
        metrics.answered(d.outcome, ms / 1000)
        event("answered", ws=ws.key, id=rid, outcome=d.outcome, ms=round(ms, 2))

    def _answer(self, rec: _Recorded, ws: WorkspaceRow, r: _Read, answer: bytes, outcome: str) -> None:
        only = self._read_as.pop((ws.key, r.rid), None)
        rec.deliveries.append(_Delivery(r.rid, answer, outcome, r.received, only))

    def _decide(self, ws: WorkspaceRow, r: _Read, rec: _Recorded) -> None:
        rid, received = r.rid, r.received
        if r.refused is not None:
            if r.refused == "vanished":
                return
            code = "request.too_large" if r.refused.startswith("larger than") else "request.unreadable"
            err = RequestError(
                code,
                f"requests/{rid}.json is {r.refused}; write a regular file of at most "
                f"{L.REQUEST_MAX_BYTES} bytes and rename it into requests/ (the tool does this)",
            )
            self._read_as.pop((ws.key, rid), None)
            self._answer(rec, ws, r, encode(rejected(rid, err)), f"rejected:{code}")
            return
        data = r.data
        assert r.inode is not None  # read
        self._read_as[(ws.key, rid)] = r.inode
        digest = hashlib.sha256(data).hexdigest()
        known = self.store.request(ws.key, rid)
        if known is not None:
            if known.sha256 != digest:
                err = RequestError(
                    "request.id.reused",
                    f"id {rid!r} was used before (at {known.received_at}) by a request with different content; "
                    "use a new id for a new request",
                    "$.id",
                )
                self._answer(rec, ws, r, encode(rejected(rid, err)), "rejected:request.id.reused")
                return
            if known.answer is None:
                # Being resumed already (busy), backing off after a failure (retried when `due_retries` says
                # so), or interrupted by a crash: resume it.
                if ws.key in self.busy or self._backing_off(ws.key):
                    return
                rec.cont = self._resume(known)
                return
            # Its record may be one a killed process committed without the WAL's fsync (a read-only answer
            # whose request was never removed): synced before the request is removed, like a new one.
            rec.unsynced = True
            self._answer(rec, ws, r, known.answer, "replayed")
            return
        now = timestamp(received)
        decoded = decode_request(data, rid)
        match decoded:
            case Rejected():
                answer = self._record_answer(ws.key, rid, digest, "invalid", now, decoded)
                self._answer(rec, ws, r, answer, f"rejected:{decoded.error.code}")
                return
            case StatusRequest() | QueueRequest() | HistoryRequest() | TailRequest():
                try:
                    # read-only verbs obey the policy's `verbs` too (an operator may withhold `queue`)
                    check_policy(decoded, ws.policy)
                except RequestError as err:
                    answer = self._record_answer(ws.key, rid, digest, _verb(decoded), now, rejected(rid, err))
                    self._answer(rec, ws, r, answer, f"rejected:{err.code}")
                    return
                if isinstance(decoded, TailRequest):
                    try:
                        rec.look = self._tail_look(ws.key, r, digest, decoded)
                    except RequestError as err:  # a tail of a task the sleep does not have
                        self._record_read_only(
                            rec, ws, r, digest, "tail", rejected(rid, err), f"rejected:{err.code}"
                        )
                    return
                outcome = _verb(decoded)
                # Recorded without the WAL's fsync, so the answer is shown a disk flush sooner; `_deliver_all`
                # syncs the store before the request is removed. A power cut before that leaves the request in
                # place with no record, and it is answered afresh (read-only: nothing is done twice).
                rec.unsynced = True
                with self.store.transaction(durable=False):
                    row = self.store.workspace(ws.key)
                    assert row is not None
                    msg: StatusAnswer | QueueAnswer | HistoryAnswer | Rejected
                    try:
                        msg = self._read_only(row, decoded, received)
                    except RequestError as err:  # a status of a sleep the workspace does not have
                        msg, outcome = rejected(rid, err), f"rejected:{err.code}"
                    answer = encode(self._told(row, msg))
                    self.store.insert_request(
                        RequestRow(ws.key, rid, digest, _verb(decoded), now, None, None, answer, now)
                    )
                self._answer(rec, ws, r, answer, outcome)
                return
            case SleepRequest():
                self._sleep(ws, rec, r, digest, decoded, now)
                return
            case CancelRequest():
                self._cancel(ws, rec, r, digest, decoded, now)
                return
        raise AssertionError(f"unhandled request type {type(decoded).__name__}")  # pragma: no cover

    def _told(self, ws: WorkspaceRow, msg: A) -> A:
        """(in the transaction recording it) The answer with what of the contract changed since the last answer
        or wake to the workspace (kernel.service.telling); `ws` as read in this transaction."""
        return telling.told(self.store, self.cfg, ws, msg)

    def _record_answer(self, key: str, rid: str, digest: str, kind: str, now: str, msg: Rejected) -> bytes:
        """Record a refusal, with what of the contract changed; its bytes."""
        with self.store.transaction():
            row = self.store.workspace(key)
            assert row is not None
            answer = encode(self._told(row, msg))
            self.store.insert_request(RequestRow(key, rid, digest, kind, now, None, None, answer, now))
        return answer

    def _record_read_only(
        self,
        rec: _Recorded,
        ws: WorkspaceRow,
        r: _Read,
        digest: str,
        kind: str,
        msg: TailAnswer | Rejected,
        outcome: str,
    ) -> None:
        """Record a read-only answer (with what of the contract changed) without the WAL's fsync (`_deliver_all`
        syncs it before the request is removed), and deliver it."""
        now = timestamp(r.received)
        rec.unsynced = True
        with self.store.transaction(durable=False):
            row = self.store.workspace(ws.key)
            assert row is not None
            answer = encode(self._told(row, msg))
            self.store.insert_request(RequestRow(ws.key, r.rid, digest, kind, now, None, None, answer, now))
        self._answer(rec, ws, r, answer, outcome)

    def _read_only(
        self, ws: WorkspaceRow, req: StatusRequest | QueueRequest | HistoryRequest, now: float
    ) -> StatusAnswer | QueueAnswer | HistoryAnswer:
        key = ws.key
        match req:
            case StatusRequest():
                in_flight = self._in_flight(key)
                shown = rules.status_target(in_flight, self._named(key, req.sleep), self._last(key), req)
                building = self.executor.environment_of(key, shown[0].seq) if shown else None
                return rules.status_answer(req.id, self.kernel, ws, shown, in_flight, now, building)
            case QueueRequest():
                ids = {s.seq: s.id for s in self.store.sleeps_in_flight(key)}
                return rules.queue_answer(req.id, key, self.store.live_jobs(), now, ids)
            case HistoryRequest():
                sleeps = self.store.sleeps(key, req.limit)
                commits = self.store.snapshot_commits(key, [s.seq for s in sleeps])
                return rules.history_answer(
                    req.id, [(s, self.store.jobs_of(key, s.seq)) for s in sleeps], commits, req.metric
                )

    def _in_flight(self, key: str) -> list[rules.Sleep]:
        """(store step) The workspace's sleeps in flight, oldest first, each with its tasks."""
        return [(s, self.store.jobs_of(key, s.seq)) for s in self.store.sleeps_in_flight(key)]

    def _named(self, key: str, sleep_id: str | None) -> rules.Sleep | None:
        """(store step) The workspace's sleep of the id a request names, with its tasks; None without one."""
        s = None if sleep_id is None else self.store.sleep_by_id(key, sleep_id)
        return None if s is None else (s, self.store.jobs_of(key, s.seq))

    def _last(self, key: str) -> rules.Sleep | None:
        """(store step) The workspace's newest sleep, with its tasks."""
        s = next(iter(self.store.sleeps(key, 1)), None)
        return None if s is None else (s, self.store.jobs_of(key, s.seq))

    def _tail_look(self, key: str, r: _Read, digest: str, req: TailRequest) -> _TailLook:
        """The task a `tail` names, from the store only (its run directory is read after the step)."""
        sleep, job = rules.tail_target(
            self._in_flight(key), self._named(key, req.sleep), self._last(key), req
        )
        building = (
            self.executor.environment_log(key, sleep.seq, req.lines) if job.state == "PENDING" else None
        )
        return _TailLook(r, digest, req, sleep.id, job, building)

    def _sleep(
        self, ws: WorkspaceRow, rec: _Recorded, r: _Read, digest: str, req: SleepRequest, now: str
    ) -> None:
        rid, data = r.rid, r.data
        refusal: tuple[str, bytes] | None = None  # (code, answer)
        with self.store.transaction():
            row = self.store.workspace(ws.key)
            assert row is not None
            seq = self.store.next_seq(ws.key)
            try:
                submits = (
                    self.store.submits_since(ws.key, rules.submit_window_start(now))
                    if req.submit is not None and row.policy.max_submits_per_day
                    else (0, None)
                )
                acc = rules.accept_sleep(row, self._in_flight(ws.key), req, seq, now, submits)
            except RequestError as err:
                refusal = (err.code, encode(self._told(row, rejected(rid, err))))
                self.store.insert_request(
                    RequestRow(ws.key, rid, digest, "sleep", now, None, None, refusal[1], now)
                )
            else:
                self.store.insert_sleep(
                    SleepRow(
                        workspace=ws.key,
                        seq=seq,
                        id=rid,
                        state=next_sleep_state("received", SleepEvent.VALIDATE),
                        note=req.note,
                        submit=None if req.submit is None else encode(req.submit),
                        created_at=now,
                        woken_at=None,
                        verdict=None,
                        wake_on=req.wake_on,
                        rest=req.rest,
                    )
                )
                self.store.insert_jobs(acc.jobs)
                self.store.set_balance(ws.key, acc.balance)
                self.store.insert_request(
                    RequestRow(ws.key, rid, digest, "sleep", now, seq, data, None, None)
                )
        if refusal is not None:  # the answer delivered is the bytes recorded
            self._answer(rec, ws, r, refusal[1], f"rejected:{refusal[0]}")
            return
        rec.budget = (acc.balance, now, self.store.budget_order.stamp())
        event("sleep_recorded", ws=ws.key, id=rid, seq=seq, launches=len(req.launches), tasks=len(acc.jobs))
        rec.cont = Continuation("sleep", ws.key, rid, seq, received=r.received)

    def _cancel(
        self, ws: WorkspaceRow, rec: _Recorded, r: _Read, digest: str, req: CancelRequest, now: str
    ) -> None:
        rid, data = r.rid, r.data
        refusal: tuple[str, bytes] | None = None  # (code, answer)
        with self.store.transaction():
            row = self.store.workspace(ws.key)
            assert row is not None
            try:
                plan = rules.plan_cancel(row, self._in_flight(ws.key), self._named(ws.key, req.sleep), req)
            except RequestError as err:
                refusal = (err.code, encode(self._told(row, rejected(rid, err))))
                self.store.insert_request(
                    RequestRow(ws.key, rid, digest, "cancel", now, None, None, refusal[1], now)
                )
            else:
                for j in plan.now_cancelled:
                    moved = self.store.advance_task(
                        ws.key,
                        j.seq,
                        j.launch,
                        j.task,
                        j.state,
                        TaskEvent.CANCEL,
                        at=now,
                        ended_at=now,
                        release=True,
                    )
                    assert moved, (ws.key, j.seq, j.launch, j.task, j.state)  # read in this transaction
                self.store.set_balance(ws.key, plan.balance)
                self.store.insert_request(
                    RequestRow(ws.key, rid, digest, "cancel", now, plan.sleep.seq, data, None, None)
                )
        if refusal is not None:  # the answer delivered is the bytes recorded
            self._answer(rec, ws, r, refusal[1], f"rejected:{refusal[0]}")
            return
        rec.budget = (plan.balance, now, self.store.budget_order.stamp())
        event("cancel_recorded", ws=ws.key, id=rid, seq=plan.sleep.seq, tasks=len(plan.targets))
        rec.cont = Continuation("cancel", ws.key, rid, plan.sleep.seq, req.launches, received=r.received)

    def _resume(self, row: RequestRow) -> Continuation:
        assert row.sleep_seq is not None, row
        assert row.body is not None, row
        names: tuple[str, ...] = ()
        if row.type == "cancel":
            req = parse_request(row.body, row.id)
            assert isinstance(req, CancelRequest)
            names = req.launches
        return Continuation(row.type, row.workspace, row.id, row.sleep_seq, names, received=self.clock())

    # --- continuations: executor calls between two worker steps -------------------------------------------

    def _order(self, c: Continuation) -> SleepOrder:
        ws = self.store.workspace(c.key)
        sleep = self.store.sleep(c.key, c.seq)
        row = self.store.request(c.key, sleep.id if sleep else c.request_id)
        assert ws is not None
        assert sleep is not None
        assert row is not None
        assert row.body is not None
        req = parse_request(row.body, sleep.id)
        assert isinstance(req, SleepRequest)
        return SleepOrder(
            workspace=ws, sleep=sleep, request=req, jobs=tuple(self.store.jobs_of(c.key, c.seq))
        )

    async def advance(self, c: Continuation) -> None:
        """Call the executor for a recorded sleep or cancel, then record and deliver its answer."""
        try:
            await self._advance(c)
        except StoreUnavailable:
            # Logged by the worker. Nothing of the failed step was committed; the request stays recorded and
            # unanswered, and the next rescan's recover resumes it.
            pass
        except ChannelIOAbandoned:
            pass  # stopping with this channel's I/O overdue: the recorded answer is replayed at the next start
        finally:
            self.busy.discard(c.key)
            self.dirty.add(c.key)
            self.hooks.idle(c.key)

    async def _advance(self, c: Continuation) -> None:
        order = await self.worker.call(self._order, c)
        try:
            if c.kind == "sleep":
                try:
                    refs = await self.executor.dispatch(order)
                except DispatchRefused as refusal:
                    self._recovered(c.key)  # the executor answered: a refusal is not the world's fault
                    done = await self.worker.call(self._refuse_sleep, c, order, refusal.error)
                else:
                    done = await self.worker.call(self._finish_sleep, c, refs)
                    self._recovered(c.key)
            else:
                await self.executor.cancel(order, c.names)
                done = await self.worker.call(self._finish_cancel, c, order)
                self._recovered(c.key)
        except ExecutorUnavailable as exc:
            self._failed(c, str(exc))
            return
        await self._deliver_answered(c, done)

    async def _deliver_answered(self, c: Continuation, done: _Answered) -> None:
        """A continuation's recorded answer, delivered through the channel I/O pool."""
        try:
            self.answered += await self.chanio.run(
                c.key,
                self._deliver_recorded,
                done.ws,
                done.stamp,
                c.request_id,
                done.answer,
                done.outcome,
                c.received,
            )
        except (safefs.ChannelMoved, safefs.Refused, OSError) as exc:
            self._failed_io(c.key, exc)

    # --- backoff after the executor failed for the world's reasons ------------------------------------------

    def _backing_off(self, key: str) -> bool:
        b = self._backoff.get(key)
        return b is not None and self.hooks.plan_clock() < b.until

    def _failed(self, c: Continuation, error: str) -> None:
        b = self._backoff.get(c.key)
        failures = 1 if b is None else b.failures + 1
        delay = rules.retry_delay(failures, RETRY_BASE_S, RETRY_CAP_S)
        self._backoff[c.key] = _Backoff(failures, self.hooks.plan_clock() + delay, error)
        if b is None or b.error != error:  # logged once per state change, not once per retry
            event(
                "executor_unavailable",
                logging.WARNING,
                ws=c.key,
                id=c.request_id,
                error=error,
                retry_in_s=delay,
            )

    def _recovered(self, key: str) -> None:
        b = self._backoff.pop(key, None)
        if b is not None:
            event("executor_available", ws=key, failures=b.failures)

    def due_retries(self) -> float | None:
        """Mark the workspaces whose backoff has ended for listing; the next end still ahead, if any, so the
        service wakes up for it: on `plan_clock`, the service's clock, which its other wake-up times are on."""
        now = self.hooks.plan_clock()
        later: float | None = None
        for key, b in self._backoff.items():
            if b.until <= now:
                if key not in self.busy:
                    self.dirty.add(key)
            elif later is None or b.until < later:
                later = b.until
        return later

    def _answer_and_deliver(
        self, c: Continuation, make: Callable[[WorkspaceRow], Accepted | Rejected | Cancelled], outcome: str
    ) -> _Answered:
        """Record the continuation's answer (unless one is recorded already); it is delivered after this step
        (`_advance`: channel I/O never runs on the store worker)."""
        with self.store.transaction():
            ws = self.store.workspace(c.key)
            known = self.store.request(c.key, c.request_id)
            assert ws is not None
            assert known is not None
            answer = known.answer if known.answer is not None else encode(self._told(ws, make(ws)))
            if known.answer is None:
                self.store.set_answer(c.key, c.request_id, answer, timestamp(self.clock()))
        return _Answered(ws, answer, outcome, self.store.budget_order.stamp())

    def _finish_sleep(self, c: Continuation, refs: tuple[JobRef, ...]) -> _Answered:
        def make(ws: WorkspaceRow) -> Accepted:
            return Accepted(
                protocol=L.PROTOCOL_VERSION,
                id=c.request_id,
                sleep_seq=c.seq,
                jobs=refs,
                budget=ws.balance.to_message(),
                building=building,
            )

        building = self.executor.accepted_building(c.key, c.seq)
        return self._answer_and_deliver(c, make, "accepted")

    def _refuse_sleep(self, c: Continuation, order: SleepOrder, err: RequestError) -> _Answered:
        now = timestamp(self.clock())
        with self.store.transaction():
            ws = self.store.workspace(c.key)
            sleep = self.store.sleep(c.key, c.seq)
            assert ws is not None
            assert sleep is not None
            if sleep.state != "rejected":
                jobs = self.store.jobs_of(c.key, c.seq)
                balance = ledger.refund_rejected_sleep(ws.balance, len(order.request.launches), jobs)
                for j in jobs:
                    if j.state == "PENDING":
                        moved = self.store.advance_task(
                            c.key,
                            c.seq,
                            j.launch,
                            j.task,
                            "PENDING",
                            TaskEvent.CANCEL,
                            at=now,
                            ended_at=now,
                            release=True,
                        )
                        assert moved, (c.key, c.seq, j.launch, j.task)  # read in this transaction
                self.store.set_balance(c.key, balance)
                advanced = self.store.advance_sleep(c.key, c.seq, sleep.state, SleepEvent.REJECT)
                assert advanced, (c.key, c.seq, sleep.state)  # read in this transaction
        return self._answer_and_deliver(c, lambda ws: rejected(c.request_id, err), f"rejected:{err.code}")

    def _finish_cancel(self, c: Continuation, order: SleepOrder) -> _Answered:
        row = self.store.request(c.key, c.request_id)
        assert row is not None
        targets = rules.cancelled_by(order.jobs, c.names, row.received_at)

        def make(ws: WorkspaceRow) -> Cancelled:
            return Cancelled(
                protocol=L.PROTOCOL_VERSION,
                id=c.request_id,
                sleep=order.sleep.id,
                cancelled=rules.job_refs(targets),
                budget=ws.balance.to_message(),
            )

        return self._answer_and_deliver(c, make, "cancelled")

    # --- start-up -----------------------------------------------------------------------------------------

    async def recover(self, spawn: Spawn | None = None) -> int:
        """Resume every request recorded but not answered (a crash interrupted it, or the executor was
        unavailable); return how many were resumed."""
        rows = await self.worker.call(self.store.unanswered)
        resumed = 0
        for row in rows:
            if row.workspace in self.workspaces and row.workspace not in self.busy:
                resumed += 1
                await self._start(self._resume(row), spawn)
        return resumed


def _look_at(look: _TailLook) -> _TailSeen:
    """A task's output so far, read from its run directory (kernel-owned; the log itself never through a
    symlink) with a bounded read, so a tail of a 2-hour job costs what a status does. Never in a store step."""
    run_dir = look.job.run_dir
    if look.building is not None:
        text, size, cut = look.building
        return _TailSeen(gather.LiveTail(text, len(text.splitlines()), size, cut), False)
    if not run_dir:
        return _TailSeen(gather.read_tail(None, look.req.lines), False)
    stream = RunPaths.STDERR if look.req.stderr else RunPaths.STDOUT
    live = gather.read_tail(Path(run_dir) / stream, look.req.lines)
    return _TailSeen(live, look.job.state == "PENDING" and (Path(run_dir) / RunPaths.STARTED).exists())


def _tail_answer(look: _TailLook, seen: _TailSeen) -> TailAnswer:
    job, req = look.job, look.req
    # A PENDING task whose `started` is there started on its node; the executor's next sweep records it.
    return TailAnswer(
        protocol=L.PROTOCOL_VERSION,
        id=req.id,
        sleep=look.sleep_id,
        launch=job.launch,
        task=job.task,
        state="RUNNING" if seen.started else job.state,
        stream="environment" if look.building is not None else "stderr" if req.stderr else "stdout",
        text=seen.live.text,
        lines=seen.live.lines,
        size=seen.live.size,
        cut=seen.live.cut,
        job_id=job.job_id,
    )


def _verb(req: StatusRequest | QueueRequest | HistoryRequest | TailRequest) -> str:
    return str(req.__struct_config__.tag)
