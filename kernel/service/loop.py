"""`syscall-kernel serve`: the long-running service, one anyio task group.

Start: enroll the config's `workspaces` globs (expanded, the new channels made and their filesystems synced in the
channel look pool, each waited for at most `channel_io_deadline_seconds`: what hangs is enrolled once it returns,
and holds nothing else), admit every enrolled channel (the enrolled directory, its owner, its lock) and watch it
(inotify, or polling on network filesystems), in the channel look pool too (a channel that hangs there is served
once it returns, and holds nothing else), let the executor recover, resume interrupted requests, then tell
systemd READY=1; the kernel-written files (tool, kernel.json, budget.json) and leftover temp
files are refreshed after that, in the background. Serve: wait for an event, a poll tick, the periodic
rescan or the end of a workspace's turn, then start one bounded, fair pipeline pass (its turns run as tasks: the
loop never waits for a workspace's channel I/O), and repeat. WATCHDOG=1 is sent only while the watcher thread is
alive and no store step has run longer than `stall_seconds` (the ping task itself runs on the loop, so a stuck
loop stops it too). SIGTERM/SIGINT: STOPPING=1, finish the turns in flight (no new one starts; one whose channel
I/O is past `channel_io_deadline_seconds` is abandoned to its thread), stop the watcher, close the store;
unhandled requests stay on disk for the next start. Whatever still runs STOP_DEADLINE_S after the signal is
abandoned (`arm_stop_deadline`): the process is gone within a second at any point.

Every workspace's serving state (phase, problem, stale files, republishes, whether it is polled, the poll
schedule) is the pure serve core's (kernel.core.serving): this module is its driver. It turns what happens into
events (`_feed`) and runs the actions the core returns (`_act`: log, write a workspace's problem to the store, start
a look, a refresh, a republish, serve the rows again) in the pools, as tasks whose outcome comes back as another
event. Only the event loop feeds the core: a pool call (an admission, a look) or a store step returns what it found
(a `LookDone`, the rows to look at), or, for the start's admission calls that take one channel after another,
appends it to the admission's hand-over list, which the loop drains (`_drain`); the pipeline's turns report through
its `PipelineHooks`, on the loop.

Who owns what: the serve core every workspace's phase and problem; `Custody` (kernel.service.custody) the channel
locks; the `Pipeline` (kernel.service.pipeline) the served rows and each one's requests in flight; `Watches`,
`Poller`, `Refresher`, `Enroller` their own work in flight; `LiveConfig` the running config. The service gives each
what it needs at construction (callbacks included) and never writes another object's attributes (a test checks:
tests/unit/test_kernel_layers_writes.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
from anyio.lowlevel import EventLoopToken
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from channel import safefs
from kernel.core import serving as sv
from kernel.core.config import Config, ConfigError, LiveConfig
from kernel.core.config import load as load_config
from kernel.core.polling import PollSchedule, RescanLedger
from kernel.core.records import WorkspaceRow
from kernel.io import crash, log, metrics
from kernel.io import enroll as enrollment
from kernel.io.install import ToolSource
from kernel.io.store import Store, StoreUnavailable, StoreWorker, disk_failure, timestamp
from kernel.io.watch import Watcher, choose_mode, fs_type_of, is_network_fs, read_mounts
from kernel.service import reload
from kernel.service.chanio import (
    CHANNEL_IO_SLOTS,
    OVERDUE_MAX,
    ChannelIO,
    ChannelIOAbandoned,
    store_step,
    timed_afresh,
)
from kernel.service.custody import Custody
from kernel.service.enrolling import Enroller
from kernel.service.executor import Executor, PendingExecutor
from kernel.service.notify import Notifier
from kernel.service.pipeline import Pipeline, PipelineHooks, Spawn
from kernel.service.polling import Poller, evidence_of, stamp_of
from kernel.service.refreshing import Refresher
from kernel.service.watching import CHANNEL_ERRORS, Watches, channel_problem

# Keys queued from the inotify thread; the thread never queues a key twice, so this bounds distinct channels with
# fresh events between two passes. Beyond it, the watcher asks for a full rescan instead.
EVENT_STREAM_SIZE = 4096
STATUS_EVERY_S = 5.0
STORE_RETRY_S = 2.0
# SIGTERM is honoured within a second at any point: past STOP_DEADLINE_S the process exits whatever is still
# running (arm_stop_deadline), after waiting at most COMMIT_WAIT_S for a COMMIT in progress.
STOP_DEADLINE_S = 0.6
COMMIT_WAIT_S = 0.25
# Start-up admission: calls in the channel look pool, each taking the next channel from a shared queue until both
# queues are empty, so the event loop hops a few times in all, not once per workspace (10,000 of them). Channels on
# a network filesystem (a call mostly waits for the server) are taken by up to ADMIT_CALLS calls at once; those on
# a local one by one call (each is a few syscalls and some Python: more threads only contend for the GIL; at 2,000
# enrolled on 2 cores, 8 calls made a restart 0.35 -> 0.62 s, one call kept it as before). A hung channel holds its
# call only: past the deadline another call takes the rest.
ADMIT_CALLS = CHANNEL_IO_SLOTS
GIL_SWITCH_S = 0.001
# The polled channels' looks start at most this often (each start takes every look then due, in batches): a
# look is due at most this much late, and the loop never wakes more often than this for looks.
LOOK_QUANTUM_S = 0.02
T = TypeVar("T")
# Why a start-up or rescan check (`_admit_io`, `_refresh_io`) does not serve a channel: `Service._not_served` says
# what each means.
NOT_SERVED = (enrollment.OwnedElsewhere, enrollment.HeldElsewhere, *CHANNEL_ERRORS)

ExecutorFactory = Callable[[StoreWorker], Executor]


@dataclasses.dataclass(frozen=True, slots=True)
class _Changes:
    """What another process changed in the store (`Service._read_changes`): the paused workspaces, the rows,
    the held workspaces whose budget.json does not show their balance, and the workspaces unenrolled."""

    paused: frozenset[str]
    rows: list[WorkspaceRow]
    unshown: frozenset[str]
    unenrolled: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True, eq=False)
class _Admission:
    """A start's admission of the enrolled channels (`Service._admit_all`), shared by its pool calls."""

    todo: deque[WorkspaceRow]  # on local filesystems
    remote: deque[WorkspaceRow]  # on network filesystems
    fresh: set[str]
    network: set[str]
    mine: str
    seen: dict[str, enrollment.Fingerprint]
    settled: anyio.Event
    paused: frozenset[str]  # as the start read them: not watched
    # Handed from the pool calls to the event loop (which alone feeds them to kernel.core.serving): the row each
    # call is on now, and each channel's outcome in the order admitted (`Service._drain`).
    current: dict[str, WorkspaceRow] = dataclasses.field(default_factory=dict)
    results: list[sv.LookDone] = dataclasses.field(default_factory=list)
    drained: int = 0
    # Calls started, and those neither returned nor overdue: the start waits for these alone.
    started: int = 0
    running: int = 0
    # Calls past the deadline on one channel: their channel is admitted (and served) once its I/O returns.
    overdue: set[str] = dataclasses.field(default_factory=set)

    def call_started(self) -> str:
        """A new call of this admission starts: its name."""
        self.started += 1
        self.running += 1
        return f"start-up admission {self.started}"

    def call_returned(self, call: str) -> None:
        """`call` returned (one past its deadline was waited for no longer already: `call_overdue`)."""
        if call not in self.overdue:
            self.running -= 1
            self.settle_if_idle()

    def call_overdue(self, call: str) -> None:
        """`call` is past its deadline on one channel: the start waits for it no longer."""
        self.overdue.add(call)
        self.running -= 1

    def settle_if_idle(self) -> None:
        """The admission is settled (the start goes on) once no call is left to wait for."""
        if self.running == 0:
            self.settled.set()

    def take_results(self) -> list[sv.LookDone]:
        """The outcomes the calls handed over since the last take, in the order admitted."""
        end = len(self.results)
        done = self.results[self.drained : end]
        self.drained = end
        return done


class Service:
    def __init__(
        self,
        live: LiveConfig,
        store: Store,
        notifier: Notifier,
        tool: ToolSource,
        executor_factory: ExecutorFactory = PendingExecutor,
        clock: Callable[[], float] = time.monotonic,
        *,
        publish: Callable[[str], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.live = live
        self.store = store
        self.worker = StoreWorker(store)
        self.notifier = notifier
        self.tool = tool
        self.executor = executor_factory(self.worker)
        self.clock = clock
        # Every workspace's serving state (phase, problem, stale files, republishes, polled or watched, the poll
        # schedule): changed by the event loop alone, through `_feed` (kernel.core.serving).
        self.serving = sv.Serving(self.cfg.poll_seconds, self.cfg.poll_idle_seconds, LOOK_QUANTUM_S)
        # The request path; what its turns find goes to the serving state (`_feed`), and their ends wake the loop.
        self.pipeline = Pipeline(
            live,
            self.worker,
            self.executor,
            hooks=PipelineHooks(
                idle=self._wake,
                turn_done=lambda: self._wake(""),
                listed=self._listed,
                plan_clock=clock,
                answered=lambda key: self.polls.active(key, self.clock()),
                owned_elsewhere=self._taken_over,
                store_id=lambda: self._mine or None,
                ok=lambda key: self._feed(sv.TurnOk(key)),
                failed=lambda key, why: self._feed(sv.ChannelFailed(key, why)),
                overdue=lambda key, since, deadline: self._feed(
                    sv.TurnOverdue(key, timestamp(since), deadline)
                ),
                returned=lambda key: self._feed(sv.TurnReturned(key)),
            ),
        )
        # Where the status line also goes (the state dir lock's note, read by `syscall-kernel status`).
        self.publish: Callable[[str], None] = publish or (lambda line: None)
        # Called once when the service is asked to stop (`serve` arms the stop deadline there).
        self.on_stop: Callable[[], None] = on_stop or (lambda: None)
        self.watcher: Watcher | None = None
        self.stopping = False
        self._wait_scope: anyio.CancelScope | None = None
        # The store's data_version at the last look for other processes' changes. Read and written only in store
        # steps (`_startup`, `_read_changes`), which the store's step lock runs one at a time.
        self._data_version = -1
        self._send: MemoryObjectSendStream[str] | None = None
        # While the service loop waits for news: how it starts a turn (`_arrived` starts one at once).
        self._starter: tuple[Callable[..., object], Spawn] | None = None
        self._reload_wanted = False
        self._reserving = False  # an `_apply_current` runs (`_reserve`); `_reserve_again`: another after it
        self._reserve_again = False
        # Every workspace the store lists as enrolled, as this kernel last read them: one another process (the
        # operator's `enroll`, `unenroll`) adds or removes is logged when the poll tick notices it. Read and written
        # only in store steps (`_startup`, `_to_serve`, `_read_changes`), as `_data_version`.
        self._enrolled: set[str] = set()
        # Why the last SIGHUP's config could not be used (None: it was, or none came): in the status line until a
        # reload succeeds.
        self._reload_problem: str | None = None
        # The locks of the channels this kernel holds (kernel.service.custody); why it does not serve the others is
        # the serving state's.
        self.custody = Custody()
        # Channels enrolled by this start's round (`Enroller.enroll`: recorded, locked): `_admit_io` only watches
        # them.
        # (Those a later round enrolls are looked at in full, as any channel new to the running kernel.)
        self._fresh: set[str] = set()
        # kernel.json fingerprints taken by this start's owner checks (`_admit_io`, in the channel look pool),
        # recorded by the store steps `_admitted` and, for a call that was overdue, `_record_seen` once it
        # returned. Taken item by item (`popitem`, atomic), so one added meanwhile by a call still running is
        # recorded by the next, never lost.
        self._seen_now: dict[str, enrollment.Fingerprint] = {}
        # The kernel-written files of served channels, refreshed off the store worker (kernel.service.refreshing):
        # those `_admit_io` left stale, after `ready` (`serving` says which).
        self.refresher = Refresher(
            live,
            self.worker,
            self.pipeline,
            tool,
            stopping=self.is_stopping,
            on_taken_over=self._taken_over,
            on_problem=self._refresh_failed,
        )
        # The channel look pool: the start-up admission, the running kernel's looks at channels it does not serve
        # yet (`_look`) and its re-watches of served ones (kernel.service.watching) open channels here, and the
        # enrollment expands its globs, makes new channels and syncs their filesystems here
        # (kernel.service.enrolling), never on the store worker, so a hung filesystem holds only its own workspace,
        # or only the enrollment of what lies on it (overdue past `channel_io_deadline_seconds`: `_look_overdue`).
        # Its own pool, so a look stuck past `ready` never shares a slot with the request path.
        self.looks = ChannelIO(
            lambda: self.cfg.channel_io_deadline_seconds,
            on_overdue=self._look_overdue,
            on_returned=self._look_returned,
            thread_name="channel-look",
        )
        self._admission: _Admission | None = None
        # The watches of the served channels' requests/ (kernel.service.watching): re-watches in the look pool.
        self.watches = Watches(
            self.looks,
            watcher=lambda: self.watcher,
            served=lambda key: key in self.pipeline.workspaces,
            on_watched=self._rewatched,
        )
        # The polled channels' looks (kernel.service.polling): a stat of each requests/ on the schedule's clock
        # (`serving.polls`), a listing only where it changed; only the event loop touches the schedule.
        self.poller = Poller(
            self.polls,
            self.clock,
            lambda: self.cfg.channel_io_deadline_seconds,
            on_changed=self._wake,
            stamp=stamp_of,
        )
        # The rescan's looks at every served channel (kernel.core.polling.RescanLedger): two lstats each, and a
        # full check (listing and owner read, in the pipeline) only where the evidence is not trusted.
        self.rescans = RescanLedger()
        self.rescanner = Poller(
            self.rescans,
            self.clock,
            lambda: self.cfg.channel_io_deadline_seconds,
            on_changed=self._rescan_check,
            stamp=evidence_of,
            name="rescan-look",
            counter=metrics.RESCAN_LOOKS,
            outcomes=("checked", "unchanged"),
        )
        self._next_rescan_looks = 0.0  # the earliest the next batch of the rescan's looks may start
        self._token: EventLoopToken | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._mine = ""  # this store's id, read by `_startup` (the pipeline's owner checks compare with it)
        self._ready = anyio.Event()
        # Enrollment of the globs' new matches (kernel.service.enrolling): the start's round before the admission,
        # later ones in the background after `ready`.
        self.enroller = Enroller(
            live,
            self.worker,
            self.looks,
            tool,
            claim=self.custody.claim,
            stopping=self.is_stopping,
            ready=self._ready,
            on_enrolled=self._serve_enrolled,
        )

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    @property
    def polls(self) -> PollSchedule:
        """The polled channels' schedule (kernel.core.polling), owned by `serving`."""
        return self.serving.polls

    # --- the serving state: events in, actions run (event loop only) -------------------------------------

    def _feed(self, ev: sv.Event) -> None:
        """(event loop) Hand `ev` to the serving state and run the actions it returns: the slow ones as tasks
        (their outcome comes back as another event), so the loop never waits here."""
        for action in self.serving.handle(ev):
            self._act(action)

    def _act(self, action: sv.Action) -> None:
        tg = self._tg
        match action:
            case sv.PollLooks():
                if self._token is not None:
                    rows = self.pipeline.workspaces
                    self.poller.tick(self._token, lambda key: rows[key].path if key in rows else None)
            case sv.Log(name, key, warning, fields):
                log.event(name, logging.WARNING if warning else logging.INFO, ws=key, **dict(fields))
            case sv.ShowProblem(key, problem, unless) if tg is not None:
                tg.start_soon(self.worker.call, self._show_problem, key, problem, unless)
            case sv.Look(row, paused) if tg is not None:
                tg.start_soon(self._look, row, paused)
            case sv.Reserve() if tg is not None:
                self._reserve(tg)
            case sv.Refresh(keys) if tg is not None:
                tg.start_soon(self.refresher.refresh_served, keys)
            case sv.Republish(key) if tg is not None:
                tg.start_soon(self._republish, key)

    def _reserve(self, tg: anyio.abc.TaskGroup) -> None:
        """Serve what is served now (`_apply_current`), one at a time: many looks returning at once (10,000 new
        workspaces) read the rows a few times, not once each."""
        if self._reserving:
            self._reserve_again = True
            return
        self._reserving = True

        async def run() -> None:
            try:
                while True:
                    self._reserve_again = False
                    await self._apply_current()
                    if not self._reserve_again or self.stopping:
                        return
            finally:
                self._reserving = False

        tg.start_soon(run)

    # --- health -------------------------------------------------------------------------------------------

    def healthy(self) -> bool:
        if self.stopping:
            return False
        if self.watcher is not None and not self.watcher.healthy():
            return False
        started = self.pipeline.pass_started
        return started is None or time.time() - started < self.cfg.stall_seconds

    def degraded(self) -> str | None:
        """Why the kernel cannot do all of its work now (it keeps doing the rest), or None."""
        if self.worker.failing is not None:
            return f"store writes failing: {self.worker.failing}"
        return self.executor.degraded() or self.enroller.degraded()

    def status_line(self) -> str:
        n = len(self.pipeline.workspaces)
        polled = len(self.serving.polled())
        watched = n - polled
        why = self.degraded()
        reload = (
            f"reload failed ({self._reload_problem}): running with the config loaded before; "
            if self._reload_problem
            else ""
        )
        return (
            (("degraded (" + why + "); ") if why else "")
            + reload
            + (
                f"serving {n} workspaces ({watched} inotify, {polled} poll); "
                f"{self.pipeline.answered} requests answered; last pass {self.pipeline.last_pass_ms:.1f} ms"
            )
        )

    def _rewatched(self, key: str, polled: bool | None) -> None:
        """A re-watch ended with what it made (`Watches.watch_one`): list `key`'s whole requests/ (what was
        committed while it was not watched). One of a workspace no longer served (unenrolled meanwhile) tells the
        serve core nothing."""
        if polled is not None and key in self.pipeline.workspaces:
            self._feed(sv.Watched(key, polled))
        self.pipeline.mark(key)
        self._wake("")

    def is_stopping(self) -> bool:
        return self.stopping

    def halted(self) -> bool:
        """Whether SIGTERM/SIGINT (or `stop`) has asked the service to stop; set from the loop, read anywhere."""
        return self.stopping

    def stop(self, why: str) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.event("stopping", reason=why)
        self.notifier.stopping(f"draining ({why}): finishing the turns in flight")
        self.on_stop()
        self._feed(sv.Stop())
        self.looks.stop()
        if self._admission is not None:
            self._admission.settled.set()
        self.enroller.stop()
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    # --- start-up (worker thread) -------------------------------------------------------------------------

    async def _serve_enrolled(self, keys: list[str]) -> None:
        """After a running kernel's enrollment round (`Enroller.soon`): each workspace it enrolled is looked at
        (`_look`) and then served."""
        looks, rows = await self.worker.call(self._to_serve, keys)
        self._look_at_rows(looks)
        await self._apply_rows(rows)

    def _to_serve(self, keys: list[str]) -> tuple[list[WorkspaceRow], list[WorkspaceRow]]:
        """(a store step) After a running kernel's enrollment round: each new workspace, given the policy of the
        config now (a SIGHUP may have come during the round), is looked at before it is served. (the rows to
        look at, the rows)."""
        new = set(keys)
        self._enrolled |= new  # enrolled by this kernel: not another process's `enroll`
        looks = []
        for row in self.store.workspaces():
            if row.key in new:
                policy = enrollment.policy_for(self.store, row.key, self.cfg)
                if policy != row.policy:
                    with self.store.transaction():
                        self.store.set_policy(row.key, policy)
                    row = dataclasses.replace(row, policy=policy)
                looks.append(row)
        return looks, self.store.workspaces()

    def _look_at_rows(self, rows: list[WorkspaceRow]) -> None:
        """(event loop) Look at each of these rows' channels (once per workspace while its look is in flight),
        not serving them meanwhile."""
        for row in rows:
            self._feed(sv.LookWanted(row))

    def _startup(self, mounts: list[tuple[str, str]]) -> tuple[list[WorkspaceRow], _Admission]:
        """(store worker) After the start's enrollment (`Enroller.enroll`): the rows with this start's watch mode and
        policy, and the admission of their channels (`_admit_all`, in the channel look pool: no channel is opened
        here). Reads the store a few times in all, not per workspace."""
        fresh, self._fresh = self._fresh, set()
        # The store's version from which the poll tick looks for other processes' changes: read before anything
        # this start reads, so a change committed during the start (an operator's `budget` or `pause` while the
        # channels are admitted) is followed at the first tick, not taken as already seen.
        self._data_version = self._read_data_version()
        paused = frozenset(self.store.paused())
        mount_points = {point for point, _ in mounts}
        fs_of_parent: dict[str, str] = {}
        stored = self.store.workspaces()
        self._enrolled = {r.key for r in stored}
        policies = enrollment.policies_for(self.store, self.cfg, [r.key for r in stored])
        rows, changed = [], []
        # Workspaces on a network filesystem: kernel.json's ctime comes from the server's clock, which the
        # fingerprint's QUIET_NS rule cannot rely on (enrollment.owner_fingerprint): their owner is always read.
        network: set[str] = set()
        for row in stored:
            # The mount holding a workspace is its parent's unless the workspace is a mount point itself.
            parent = os.path.dirname(row.path)
            if row.path in mount_points:
                fstype = fs_type_of(row.path, mounts)
            else:
                if parent not in fs_of_parent:
                    fs_of_parent[parent] = fs_type_of(parent, mounts)
                fstype = fs_of_parent[parent]
            # The watch mode follows the filesystem and the policy follows the config, at every start (but an
            # eval contract given at enrollment stays the workspace's own).
            if is_network_fs(fstype):
                network.add(row.key)
            mode = choose_mode(self.cfg.watch, fstype)
            policy = policies[row.key]
            if mode != row.watch or policy != row.policy:
                row = dataclasses.replace(row, watch=mode, policy=policy)
                changed.append(row)
            rows.append(row)
        if changed:
            with self.store.transaction():
                for row in changed:
                    self.store.set_watch(row.key, row.watch)
                    self.store.set_policy(row.key, row.policy)
        mine = self.store.store_id()
        if mine is None:
            raise enrollment.EnrollError(f"{self.store.path}: the store has no id (open it read-write once)")
        self._mine = mine
        admission = _Admission(
            todo=deque(r for r in rows if r.key not in network),
            remote=deque(r for r in rows if r.key in network),
            fresh=fresh,
            network=network,
            mine=mine,
            seen=self.store.owners_seen(),
            settled=anyio.Event(),
            paused=paused,
        )
        return rows, admission

    def _admitted(self) -> bool:
        """(store worker) After the admission: record the kernel.json fingerprints its owner checks took."""
        self._record_seen()
        return True

    def _record_seen(self) -> None:
        seen: dict[str, enrollment.Fingerprint] = {}
        while self._seen_now:
            key, found = self._seen_now.popitem()
            seen[key] = found
        if seen:
            with self.store.transaction():
                self.store.set_owners_seen(seen)

    async def _admit_all(self, admission: _Admission, tg: anyio.abc.TaskGroup) -> None:
        """Admit every enrolled channel (`_admit_io`) in the channel look pool (one call for the local
        filesystems' channels, up to ADMIT_CALLS for the network filesystems': see ADMIT_CALLS);
        return once each channel is admitted or its call is overdue (its I/O past `channel_io_deadline_seconds`:
        `_look_overdue` shows it and starts another call for the channels left). A channel whose admission has
        not returned stays unadmitted (kernel.core.serving): not served until it returns, then served
        (`_admitter`). SIGTERM: the calls take no further channel and the start stops before serving."""
        self._admission = admission
        self._feed(sv.Paused(admission.paused))
        self._feed(sv.Admitting(tuple(r.key for r in (*admission.todo, *admission.remote))))
        if admission.todo:
            self._start_admitter(admission, tg, remote_first=False)
        for _ in range(min(ADMIT_CALLS - (1 if admission.todo else 0), len(admission.remote))):
            self._start_admitter(admission, tg, remote_first=True)
        admission.settle_if_idle()
        await admission.settled.wait()
        self._settle(admission)

    def _start_admitter(self, admission: _Admission, tg: anyio.abc.TaskGroup, *, remote_first: bool) -> None:
        tg.start_soon(self._admitter, admission, admission.call_started(), remote_first)

    def _settle(self, admission: _Admission) -> None:
        """The start goes on: channels no call took (every call overdue, past OVERDUE_MAX) are left to the
        rescan, which looks at each channel it does not serve."""
        self._drain(admission)
        for queue in (admission.todo, admission.remote):
            while queue:
                with contextlib.suppress(IndexError):
                    self._feed(sv.LookDone(queue.popleft().key, None))
        admission.settled.set()

    def _drain(self, admission: _Admission, *, stale: bool = True) -> list[str]:
        """(event loop) Feed the admission outcomes its calls handed over since the last drain (without `stale`:
        the caller refreshes them itself); their keys."""
        done = admission.take_results()
        for ev in done:
            self._feed(ev if stale else dataclasses.replace(ev, stale=False))
        return [ev.key for ev in done]

    async def _admitter(self, admission: _Admission, call: str, remote_first: bool) -> None:
        try:
            admitted = await self.looks.run(call, self._admit_from, call, admission, remote_first)
        except ChannelIOAbandoned:
            return
        finally:
            admission.call_returned(call)
        if call in admission.overdue:
            # Its channel was admitted late, maybe after `ready`: serve it (and what else this call admitted).
            await self._ready.wait()
            if self.stopping:
                return
            # Refreshed here: `refresh_served` may have passed it by (not served then).
            self._drain(admission, stale=False)
            await self.worker.call(self._record_seen)
            await self._apply_current()
            for key in admitted:
                await self.refresher.refresh_one(key, admission.mine)

    def _admit_from(self, call: str, admission: _Admission, remote_first: bool) -> list[str]:
        """(channel look pool) Admit the next channel of the shared queues (`remote_first`: the network
        filesystems' first) until both are empty; the keys admitted."""
        queues = (admission.remote, admission.todo) if remote_first else (admission.todo, admission.remote)
        admitted = []
        while not self.stopping:
            try:
                row = queues[0].popleft()
            except IndexError:
                try:
                    row = queues[1].popleft()
                except IndexError:
                    break
            admission.current[call] = row
            timed_afresh()
            found = sv.LookDone(row.key, None)  # not served: the rescan looks at it again
            try:
                found = self._admit_io(row, admission)
            except StoreUnavailable:
                pass
            finally:
                admission.current.pop(call, None)
                admission.results.append(found)
            admitted.append(row.key)
            if call in admission.overdue:  # its slot was given back: the other calls take the rest
                break
        return admitted

    def _store_step(self, fn: Callable[..., T], *args: object) -> T:
        """A store step from a channel look call: under the store worker's lock, its deadline paused."""
        with store_step():
            return self.worker.run_here(fn, *args)

    def _admit_io(self, row: WorkspaceRow, admission: _Admission) -> sv.LookDone:
        """(channel look pool) At start, before `row`'s channel is served: it is still the enrolled directory
        (device, inode, owner), its kernel.json names no other store, this kernel holds its lock; then its
        requests/ is watched. That is all a restart does per workspace before `ready` (10,000 of them must be
        ready in 2 s): rewriting the kernel-written files where stale (tool, kernel.json, budget.json,
        jobenv.json) and sweeping an earlier process's temps wait for `Refresher.refresh_served`, after `ready`
        (nothing the kernel decides reads those files, and the agent may rewrite them at any time anyway). A
        channel whose row the refresh changes (a new tool; subdirectories not recorded yet) is refreshed here in
        full instead. A channel enrolled by this very start is only watched (`prepare_new` checked its owner, took
        its lock and wrote its files moments ago). The owner check is one lstat when kernel.json is, unchanged, the
        file an earlier check read (`seen`: enrollment.owner_unchanged), else a full read whose fingerprint is
        recorded for the next start (a network filesystem's is always read). The store is touched only when the
        outcome needs it (`_store_step`). What it found (whether the kernel-written files wait for the refresh
        after `ready`, the watch it made), for the loop to hand to the serve core."""
        crash.hang_point("admit", row.path)
        paused = row.key in admission.paused
        if row.key in admission.fresh and self.custody.holds(row.key):
            return self._watch_fresh(row, paused)
        if row.tool_sha256 != self.tool.sha256 or not row.identity.subdirs:
            return self._refresh_io(row, admission.mine, watch=not paused)
        polled = None
        seen = None if row.key in admission.network else admission.seen
        try:
            with safefs.open_channel(row.path, row.identity) as ch:
                if seen is None:
                    enrollment.check_owner(self.store, ch, row.path, mine=admission.mine)
                elif not enrollment.owner_unchanged(ch, seen.get(row.key)):
                    found = enrollment.owner_fingerprint(ch, row.path, mine=admission.mine)
                    if found is not None:
                        self._seen_now[row.key] = found
                enrollment.claim_channel(self.custody.claim, row.key, ch, row.path)
                if not paused:
                    polled = self.watches.watch_one(row, ch)
        except NOT_SERVED as exc:
            return self._not_served(row, exc)
        return sv.LookDone(row.key, sv.Outcome.SERVED, stale=True, polled=polled)

    def _not_served(self, row: WorkspaceRow, exc: Exception) -> sv.LookDone:
        """(channel look pool) The one place that decides what a failed start-up or rescan check of `row`'s
        channel (`_admit_io`, `_refresh_io`) means: another kernel's store owns it, another process holds its lock
        (either way its lock is let go, so that one can take it: a store step), or it cannot be opened or read
        (retried at every rescan). Nothing was written to the channel. What it found, for the serve core, which
        logs it and shows it as the workspace's problem."""
        if isinstance(exc, enrollment.OwnedElsewhere):
            self._store_step(self.custody.release, row.key)
            return sv.LookDone(row.key, sv.Outcome.FOREIGN, owner=exc.owner)
        if isinstance(exc, enrollment.HeldElsewhere):
            self._store_step(self.custody.release, row.key)
            return sv.LookDone(row.key, sv.Outcome.HELD_ELSEWHERE, why=str(exc))
        return sv.LookDone(row.key, sv.Outcome.PROBLEM, why=channel_problem(exc))

    def _watch_fresh(self, row: WorkspaceRow, paused: bool) -> sv.LookDone:
        """(channel look pool) A channel enrolled by this very start needs no admission: only its watch."""
        if paused:
            return sv.LookDone(row.key, sv.Outcome.SERVED)
        try:
            with safefs.open_channel(row.path, row.identity) as ch:
                polled = self.watches.watch_one(row, ch)
        except CHANNEL_ERRORS as exc:
            return sv.LookDone(row.key, sv.Outcome.PROBLEM, why=channel_problem(exc))
        return sv.LookDone(row.key, sv.Outcome.SERVED, polled=polled)

    def _refresh_io(self, row: WorkspaceRow, mine: str, *, watch: bool) -> sv.LookDone:
        """(channel look pool) Check `row`'s channel as `_admit_io` does and rewrite its kernel-written files where
        stale and remove leftover kernel temps (`Refresher.rewrite_kernel_files`); with `watch` (not paused), watch
        its requests/ too. What it found (the kernel-written files are fresh: not stale). The store is touched only
        in store steps (`_store_step`, under the store worker's lock), never while the channel is: the row written
        to kernel.json and budget.json is read, with its budget stamp, in the step that records the new tool
        (kernel.io.budgetorder, as `Refresher.refresh_one`)."""
        polled = None
        try:
            with safefs.open_channel(row.path, row.identity) as ch:
                owner = enrollment.check_owner(self.store, ch, row.path, mine=mine)
                enrollment.claim_channel(self.custody.claim, row.key, ch, row.path)
                identity = row.identity
                if not identity.subdirs:
                    # A channel enrolled before subdirectory identities were recorded gets them now (what is there
                    # at this start), and is checked against them from then on.
                    identity = dataclasses.replace(identity, subdirs=ch.found_subdirs())
                current, stamp = self._store_step(self._refreshed_row, row, identity)
                if self.refresher.rewrite_kernel_files(ch, current, owner, stamp) is not None:
                    log.event("tool_updated", ws=row.key, sha256=self.tool.sha256[:16])
                if watch:
                    polled = self.watches.watch_one(row, ch)
        except NOT_SERVED as exc:
            return self._not_served(row, exc)
        return sv.LookDone(row.key, sv.Outcome.SERVED, polled=polled)

    def _refreshed_row(self, row: WorkspaceRow, identity: safefs.Identity) -> tuple[WorkspaceRow, int]:
        """(a store step) Record the new tool and the subdirectory identities where `row` lacks them (the channel
        is ours and locked). The current row and the stamp of this read of its balance."""
        current = self.store.workspace(row.key)
        if current is None:  # unenrolled meanwhile: nothing to record (nor to serve)
            return row, self.store.budget_order.stamp()
        if row.tool_sha256 != self.tool.sha256 or identity != row.identity:
            current = dataclasses.replace(current, tool_sha256=self.tool.sha256, identity=identity)
            with self.store.transaction():
                self.store.put_workspace(current)
        return current, self.store.budget_order.stamp()

    async def _look(self, row: WorkspaceRow, paused: bool) -> None:
        """The running kernel's look at a channel it does not serve yet (enrolled meanwhile, its lock let go,
        taken back): `_refresh_io` in the channel look pool, in `row`'s turn; not served (kernel.core.serving:
        `looking`) until the look returns, then served if it found the channel ours and locked it. A look past the
        deadline shows as the workspace's problem (`_look_overdue`) and holds nothing else: the service loop does
        not wait for it."""
        done = sv.LookDone(
            row.key, None
        )  # stopping, or the store cannot be written: looked at again at the rescan
        try:
            done = await self.looks.run(row.key, self._look_io, row, self._mine, paused)
        except (ChannelIOAbandoned, StoreUnavailable):
            pass
        finally:
            self._feed(done)

    def _look_io(self, row: WorkspaceRow, mine: str, paused: bool) -> sv.LookDone:
        """(channel look pool) The look itself (`_refresh_io`); what it found."""
        crash.hang_point("look", row.path)
        return self._refresh_io(row, mine, watch=not paused)

    def _start_rewatches(self) -> None:
        """Watch again each channel `Watches.watch_all` queued, in the background (`Watches.start_queued`): the
        loop does not wait for a channel."""
        self.watches.start_queued(self._tg)

    async def _apply_current(self) -> None:
        await self._apply_rows(await self.worker.call(self.store.workspaces))

    async def _look_overdue(self, call: str, since: float) -> None:
        """A look call (admission, rescan or re-watch) past the deadline on one channel: that workspace's problem
        says so (logged once); the start does not wait for it, and another admission call takes the channels
        left. An enrollment's call (a glob, a new path, a sync) has no workspace yet: its round goes on without
        it (`Enroller.overdue`)."""
        if self.enroller.overdue(call, since):
            return
        admission = self._admission
        if admission is not None and call.startswith("start-up admission "):
            row = admission.current.get(call)
            if row is not None:
                self._feed(sv.LookTaken(call, row.key))
            admission.call_overdue(call)
            left = admission.todo or admission.remote
            if left and not self.stopping and len(admission.overdue) < OVERDUE_MAX and self._tg:
                self._start_admitter(admission, self._tg, remote_first=bool(admission.remote))
            else:
                admission.settle_if_idle()
        elif call in self.watches.in_flight:
            self._feed(sv.LookTaken(call, call))  # a re-watch: its call is its workspace's key
        self._feed(sv.Overdue(call, timestamp(since), self.looks.deadline))

    async def _look_returned(self, call: str) -> None:
        self._feed(sv.Returned(call))

    def _show_problem(self, key: str, problem: str | None, unless: str | None) -> None:
        """(a store step) Show `problem` as the workspace's (the serve core's `ShowProblem`); None clears it, only
        while it still shows `unless`."""
        row = self.store.workspace(key)
        if row is None or (problem is None and row.problem != unless):
            return
        with self.store.transaction():
            self.store.set_problem(key, problem)

    async def _taken_over(self, row: WorkspaceRow, exc: enrollment.OwnedElsewhere) -> None:
        """A served channel's kernel.json names another store (the rescan's owner check, made in the
        pipeline's channel I/O pool): stop serving it (its requests are that kernel's) and let its lock go, so
        that kernel can take it."""
        await self.worker.call(self.custody.release, row.key)
        self._feed(sv.TakenOver(row.key, exc.owner))

    def _refresh_failed(self, row: WorkspaceRow, exc: Exception) -> None:
        """A refresh of served `row`'s kernel-written files could not open or read its channel: logged once (the
        serve core's), while it is served."""
        if row.key in self.pipeline.workspaces:
            self._feed(sv.ChannelFailed(row.key, channel_problem(exc), shown=False))

    def _check_owners(self) -> list[WorkspaceRow]:
        """(a store step) At every rescan: serve the channels that became ours (the rows to look at). (Whether a
        served channel was taken over by another store is checked by its next turn in the pipeline, off the store
        worker: `Pipeline.sweep(owners=True)`, `_taken_over`.)"""
        # Channels not locked yet (another process held the lock, the channel could not be opened, or its
        # kernel.json named another store when last read): served once it is ours and this kernel holds the lock.
        # The look is the loop's (`_look_at_rows`, in the channel look pool): no channel is opened here.
        # Keys first: at 10,000 served channels, reading every row at every rescan cost more than its looks.
        rows = (self.store.workspace(k) for k in self.store.enrolled_keys() if not self.custody.holds(k))
        return [row for row in rows if row is not None]

    def served(self, rows: list[WorkspaceRow]) -> list[WorkspaceRow]:
        """(event loop) The rows this kernel answers: those whose channel lock it holds (kernel.io.chanlock: so no
        other kernel answers them) and whose phase is `served` (kernel.core.serving: not another store's, not
        paused by the operator (their requests wait in their channels; their jobs in flight go on and their
        wakes are written), no look in flight)."""
        return self.serving.served(rows, self.custody.holds)

    def _read_data_version(self) -> int:
        # Changes when another process (an `enroll`) commits to the store.
        return self.store.data_version()

    def _read_changes(self) -> _Changes | None:
        """(a store step) What another process changed since the last look (None: nothing)."""
        version = self._read_data_version()
        if version == self._data_version:
            return None
        self._data_version = version
        paused = frozenset(self.store.paused())
        rows = self.store.workspaces()
        enrolled = {r.key: r for r in rows}
        for key in sorted(enrolled.keys() - self._enrolled):
            log.event("enroll_noticed", ws=key, path=enrolled[key].path, by="another process (`enroll`)")
        unenrolled = tuple(sorted(self._enrolled - enrolled.keys()))
        for key in unenrolled:
            log.event("unenroll_noticed", ws=key, by="another process (`unenroll`)")
        self._enrolled = set(enrolled)
        order = self.store.budget_order
        unshown = frozenset(
            r.key for r in rows if self.custody.holds(r.key) and not order.shows(r.key, r.balance)
        )
        return _Changes(paused, rows, unshown, unenrolled)

    def _changed(self, changes: _Changes) -> list[WorkspaceRow]:
        """(event loop) Follow what another process changed (`_read_changes`): the pauses, the channels to look
        at, the budget.json files to rewrite, the workspaces forgotten; the rows."""
        self._feed(sv.Unenrolled(changes.unenrolled))
        before = self.serving.paused()
        for key in sorted(changes.paused - before):
            log.event("paused", ws=key)
        for key in sorted(before - changes.paused):
            log.event("resumed", ws=key)
        self._feed(sv.Paused(changes.paused))
        known = self.pipeline.workspaces
        republish = []
        for row in changes.rows:
            old = known.get(row.key)
            # A channel taken back with `enroll --take-over` is served again once its refresh finds it ours.
            if old is None or old.identity != row.identity or self.serving.phase(row.key) is sv.Phase.FOREIGN:
                self._feed(sv.LookWanted(row))
            # Another process changed the balance (kernel.io.budgetorder, across processes): budget.json is
            # rewritten here, in this kernel's order. A channel still to be refreshed after `ready` (stale) is
            # read and written then, in a store step after this one.
            elif row.key in changes.unshown and not self.serving.is_stale(row.key):
                republish.append(row.key)
        self._feed(sv.BalanceChanged(tuple(republish)))
        return changes.rows

    async def _republish(self, key: str) -> None:
        """`_republish_io` in the channel I/O pool, in `key`'s turn (after whatever channel I/O of it runs now: a
        write of an older balance still in flight lands first and is then replaced). A channel that fails is tried
        again at each rescan (logged once) while this kernel holds it, until a write runs."""
        failed = False
        try:
            if self.serving.phase(key) is not sv.Phase.FOREIGN:  # another store's: nothing is written to it
                await self.pipeline.chanio.run(key, self._republish_io, key)
        except CHANNEL_ERRORS as exc:
            if key in self.pipeline.workspaces:
                self._feed(sv.ChannelFailed(key, channel_problem(exc), shown=False))
            failed = True
        except (ChannelIOAbandoned, StoreUnavailable):
            pass  # stopping, or the store cannot be read: the next start rewrites it
        finally:
            self._feed(sv.Republished(key, failed))

    def _republish_io(self, key: str) -> None:
        """(channel I/O pool) Rewrite budget.json from the store's balance, read with its stamp in a store step made
        now, after the other process's commit (kernel.io.budgetorder), if this kernel still holds the channel."""
        with store_step():
            row, stamp = self.worker.run_here(self._held_row_stamped, key)
        if row is None:
            return
        with safefs.open_channel(row.path, row.identity) as ch:
            now = timestamp()
            self.store.budget_order.write(
                key, stamp, row.balance, lambda b: enrollment.write_budget(ch, b, now, only_if_changed=True)
            )

    def _held_row_stamped(self, key: str) -> tuple[WorkspaceRow | None, int]:
        """(a store step) The row while this kernel holds its channel (None when not: a lock let go, to another
        store or process), and the stamp of this read of its balance."""
        if not self.custody.holds(key):
            return None, 0
        return self.refresher.row_stamped(key)

    async def _apply_rows(self, rows: list[WorkspaceRow]) -> None:
        """(event loop) Serve the rows now `served` (decided here, on the loop); those no longer served are
        neither watched nor polled; those served anew (or whose channel changed) are watched, unless the look
        that found them watched them already, and listed in full; then start the re-watches."""
        served = self.served(rows)
        gone, changed = await self.worker.call(self._serve_rows, {r.key for r in rows}, served)
        for key in gone:
            self.watches.forget(key)
        self._feed(sv.Unserved(tuple(gone)))
        self._feed(shown(served))
        if changed:
            watcher = self.watcher
            self._watch_all(
                served,
                {
                    k
                    for k in changed
                    if not self.serving.is_polled(k) and (watcher is None or not watcher.watching(k))
                },
            )
            for key in changed:
                self.pipeline.mark(key)
        self._start_rewatches()

    def _watch_all(self, rows: list[WorkspaceRow], only: set[str]) -> None:
        """(event loop) Watch these rows' channels (those in `only`) again (`Watches.watch_all`); those it polls
        are the serve core's to know."""
        for key in self.watches.watch_all(rows, only):
            self._feed(sv.Watched(key, polled=True))

    def _serve_rows(self, enrolled: set[str], rows: list[WorkspaceRow]) -> tuple[list[str], set[str]]:
        """(store worker) Let the unenrolled channels' locks go (and what the pipeline kept of them) and serve
        `rows`: (the workspaces no longer served, those served anew or whose channel changed)."""
        self.custody.keep_only(enrolled)  # an unenrolled channel's lock (and fd) is let go
        self.pipeline.keep_only(enrolled)
        old = self.pipeline.workspaces
        self.pipeline.set_workspaces(rows)
        new_keys = {r.key for r in rows}
        changed = {r.key for r in rows if r.key not in old or old[r.key].identity != r.identity}
        return sorted(set(old) - new_keys), changed

    # --- the service --------------------------------------------------------------------------------------

    async def run(self) -> None:
        send, recv = anyio.create_memory_object_stream[str](EVENT_STREAM_SIZE)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self.enroller.attach(tg)
            tg.start_soon(self._signals)
            try:
                # Start-up steps run on the worker thread (the store's) and in the channel look pool (the
                # channels', and the enrollment's globs, new paths and syncs) while this loop still receives
                # signals: each step stops early once `stopping` is set, and nothing after it runs, so SIGTERM is
                # honoured at any point of start-up within one step (one batch's commit, one channel's admission).
                if self.cfg.watch != "poll":  # `_admit_io` watches each channel while it has it open
                    self.watcher = Watcher(lambda key: self._arrived(send, key))
                    self.watcher.start()
                fresh = await self._retrying(self.enroller.enroll)
                if fresh is None or self.stopping:
                    return
                self._fresh = set(fresh)
                # The mount table is read before the store step (which uses sqlite only: kernel.io.stepguard).
                mounts = await anyio.to_thread.run_sync(read_mounts)
                started = await self._retrying(lambda: self.worker.call(self._startup, mounts))
                if started is None or self.stopping:
                    return
                stored, admission = started
                await self._admit_all(admission, tg)
                if self.stopping or await self._retrying(lambda: self.worker.call(self._admitted)) is None:
                    return
                rows = self.served(stored)
                self.pipeline.set_workspaces(rows)
                self._feed(shown(rows))
                if self.halted():
                    return
                await self._retrying(self.executor.recover)
                if self.halted():
                    return
                resumed = await self._retrying(self.pipeline.recover) or 0
                if self.halted():
                    return
                self.pipeline.sweep()
                log.event("ready", workspaces=len(rows), polled=len(self.serving.polled()), resumed=resumed)
                self._ready.set()
                line = self.status_line()
                self.notifier.ready(line)
                self.publish(line)  # `syscall-kernel status` says so at once, not at the next status tick
                if self.cfg.metrics_listen:
                    await self.worker.call(metrics.refresh, self.store, False)
                tg.start_soon(self._pinger)
                tg.start_soon(self.executor.run)
                self._feed(sv.Ready())  # the refresh of what the admission left stale, in the background
                self._send = send
                self._token = anyio.lowlevel.current_token()
                # Leaving `work` waits for the sleeps and cancels still at the executor (the drain); leaving
                # `turns` waits for the workspaces' turns in flight, but one whose channel I/O is overdue is
                # abandoned (`ChannelIO.stop`), so a hung filesystem cannot hold the stop.
                async with anyio.create_task_group() as work, anyio.create_task_group() as turns:
                    with recv:
                        await self._loop(
                            recv, lambda c: work.start_soon(self.pipeline.advance, c), turns.start_soon
                        )
                    self.pipeline.chanio.stop()
            finally:
                self.looks.stop()
                tg.cancel_scope.cancel()
                send.close()
                if self.watcher is not None:
                    self.watcher.stop()
                    with anyio.CancelScope(shield=True):
                        # A plain thread: the kernel's own watcher thread, waited for 10 s at most.
                        await anyio.to_thread.run_sync(self.watcher.join, 10.0)
        log.event("stopped", answered=self.pipeline.answered)

    def _take(self, key: str) -> None:
        names = None
        if self.watcher is not None:
            self.watcher.consumed(key)
            names = self.watcher.take_names(key)
        if key:
            self.pipeline.mark(key, names)

    def _arrived(self, send: MemoryObjectSendStream[str], key: str) -> None:
        """(event loop) The watcher hands over a workspace with news. While the service loop waits for news with
        nothing to do, that workspace's turn starts here and then (`Pipeline.start_now`: its channel I/O is on a
        pool thread before this returns), sparing the loop's wake-up and the turn task's first step; else, or if
        the turn cannot start now, the loop takes it from `send` (raises anyio.WouldBlock when full)."""
        starter = self._starter
        if (
            key
            and starter is not None
            and self._wait_scope is not None
            and not self._reload_wanted
            and not self.stopping
        ):
            self._take(key)
            if self.pipeline.start_now(key, *starter):
                return
            key = ""  # marked: the loop plans it
        send.send_nowait(key)

    def _rescan_check(self, key: str) -> None:
        """(event loop) The rescan's look at `key` asks for a full check: listed in full, its owner read. The loop
        is woken only when the sweep was empty (it goes on with a sweep it has by itself): a rescan that checks
        10,000 channels wakes it once, not 10,000 times (each wake plans a pass)."""
        idle = not self.pipeline.sweeping()
        self.pipeline.sweep([key], owners=True)
        if idle:
            self._wake("")

    def _listed(self, key: str, planned: float, owner_checked: bool) -> None:
        """(event loop) A turn of `key` planned at `planned` listed it in full (and read its owner)."""
        self.polls.listed(key, planned)
        if owner_checked:
            self.rescans.checked(key, planned)

    def _rescan_looks(self, now: float) -> None:
        """Start the rescan's looks now due (at most once per LOOK_QUANTUM_S); also gives up on a batch of them
        past its deadline."""
        if self._token is None:
            return
        due = self.rescans.next_at()
        if (due is not None and due <= now and now >= self._next_rescan_looks) or self.rescanner.running():
            self._next_rescan_looks = now + LOOK_QUANTUM_S
            rows = self.pipeline.workspaces
            self.rescanner.tick(self._token, lambda key: rows[key].path if key in rows else None)

    def _wake(self, key: str) -> None:
        """A workspace's continuation finished: wake the loop so its waiting requests are served now."""
        if self._send is not None:
            with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._send.send_nowait(key)

    async def _loop(
        self, recv: MemoryObjectReceiveStream[str], spawn: Spawn, start: Callable[..., object]
    ) -> None:
        """Serve until stopped; while the store cannot be written, retry every STORE_RETRY_S (the requests of a
        failed step stay in their channels, unanswered, and are listed again by the sweep that follows)."""
        while not self.stopping:
            try:
                await self._serve(recv, spawn, start)
            except StoreUnavailable:
                self._publish_status()
                await anyio.sleep(STORE_RETRY_S)
                self.pipeline.sweep()

    async def _retrying(self, step: Callable[[], Awaitable[T]]) -> T | None:
        """Await `step()`, again every STORE_RETRY_S while the store cannot be written (start-up must not
        crash-loop on a full disk); None if the kernel is stopped meanwhile."""
        while not self.stopping:
            try:
                return await step()
            except StoreUnavailable:
                self._publish_status()
                await anyio.sleep(STORE_RETRY_S)
        return None

    def _publish_status(self) -> None:
        line = self.status_line()
        self.notifier.status(line)
        self.publish(line)

    async def _serve(
        self, recv: MemoryObjectReceiveStream[str], spawn: Spawn, start: Callable[..., object]
    ) -> None:
        """The service loop. It never waits for a workspace's channel I/O, nor for any filesystem: each pass starts
        its workspaces' turns as tasks (`start`) and goes on; a turn that ends wakes it. Looks at channels not
        served yet, re-watches and the enrollment of new glob matches run as tasks too (`_feed`,
        `_start_rewatches`, `Enroller.soon`), in the channel look pool. Only its own steps on the store worker
        (reloads, the rescan's look at the store, recovery) are awaited here, and none of them touches a
        workspace's filesystem."""
        now = self.clock()
        next_rescan = now + self.cfg.rescan_seconds
        next_tick = now + self.cfg.poll_seconds
        self.rescans.sync(set(self.pipeline.workspaces), now)  # confirmed `racy_s` from now (RescanLedger)
        next_status = now + STATUS_EVERY_S
        while not self.stopping:
            retry_at = self.pipeline.due_retries()  # marks the workspaces whose backoff has ended
            self._poll()
            if not self.pipeline.has_work():
                wake_at = min(next_rescan, next_tick, retry_at if retry_at is not None else next_tick)
                look_at = self.serving.look_at()
                if look_at is not None:
                    wake_at = min(wake_at, look_at)
                rescan_at = self.rescans.next_at()
                if rescan_at is not None:
                    wake_at = min(wake_at, max(rescan_at, self._next_rescan_looks))
                timeout = max(0.0, wake_at - self.clock())
                with anyio.move_on_after(timeout) as scope:
                    self._wait_scope = scope
                    if not self.stopping:
                        self._starter = (start, spawn)  # `_arrived` may start a turn while we wait here
                        try:
                            key = await recv.receive()
                        finally:
                            self._starter = None
                        self._take(key)
                self._wait_scope = None
            while True:
                try:
                    self._take(recv.receive_nowait())
                except anyio.WouldBlock:
                    break
            if self._reload_wanted:
                await self.reload()
            if self.watcher is not None:
                if self.watcher.take_overflow():
                    log.event("rescan", reason="event overflow")
                    self.pipeline.sweep()
                lost = self.watcher.take_lost()
                if lost:
                    # Watched again in the background (`_rewatch`), but not a channel whose I/O is overdue (its
                    # re-watch would only hang a second thread): the rescan watches it once its I/O returned.
                    self._watch_all(
                        list(self.pipeline.workspaces.values()), lost - set(self.pipeline.chanio.overdue)
                    )
                    self._start_rewatches()
                    for key in lost:
                        self.pipeline.mark(key)
            now = self.clock()
            if now >= next_tick:
                next_tick = now + self.cfg.poll_seconds
                changes = await self.worker.call(self._read_changes)
                if changes is not None:
                    await self._apply_rows(self._changed(changes))
            if now >= next_rescan:
                next_rescan = now + self.cfg.rescan_seconds
                # Every served channel is looked at (its evidence); those whose evidence is not trusted are
                # listed in full with their owner read (`_rescan_check`).
                self.rescans.sync(set(self.pipeline.workspaces), now)
                self.rescans.rescan(now)
                unwatched = {
                    k
                    for k in self.pipeline.workspaces
                    if not self.serving.is_polled(k) and self.watcher is not None
                } - {k for k in self.pipeline.workspaces if self.watcher and self.watcher.watching(k)}
                unwatched -= (
                    set(self.pipeline.chanio.overdue)
                    | {k for k in self.pipeline.workspaces if self.serving.looking(k)}
                    | set(self.watches.in_flight)
                )
                if unwatched:
                    self._watch_all(list(self.pipeline.workspaces.values()), unwatched)
                self.enroller.soon()  # new glob matches, in the background
                self._look_at_rows(await self.worker.call(self._check_owners))
                self._start_rewatches()
                self._feed(sv.Rescan())
                resumed = await self.pipeline.recover(spawn)
                if resumed:
                    log.event("resumed", count=resumed)
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                self._publish_status()
                if self.cfg.metrics_listen:
                    await self.worker.call(metrics.refresh, self.store, self.degraded() is not None)
            if self.is_stopping():
                break
            failed = self.pipeline.take_store_failure()
            if failed is not None:
                raise failed
            self._rescan_looks(self.clock())
            self.pipeline.start_pass(start, spawn)
            await anyio.lowlevel.checkpoint()

    def _poll(self) -> None:
        """Start the polled channels' looks now due (their stats run on threads of their own; a changed
        requests/ comes back through `_wake`, as an event would)."""
        if self._token is not None:
            # At most once per LOOK_QUANTUM_S (`Serving.look_at`), so that 10,000 channels due one after another
            # are looked at in a few batches a second, not a thread per look.
            self._feed(sv.Tick(self.clock()))

    async def _pinger(self) -> None:
        interval = self.notifier.watchdog_interval
        if interval is None:
            return
        while True:
            if self.healthy():
                self.notifier.watchdog()
            await anyio.sleep(interval)

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    # Served by the loop between passes (never in the middle of one).
                    self._reload_wanted = True
                    if self._wait_scope is not None:
                        self._wait_scope.cancel()
                else:
                    self.stop(signal.Signals(signum).name)

    # --- SIGHUP -------------------------------------------------------------------------------------------

    async def reload(self) -> None:
        """Read the config file again and apply what may change live (kernel.service.reload)."""
        self._reload_wanted = False
        if self.cfg.source.startswith("<"):
            log.event(
                "reload_failed", logging.ERROR, problem="no config file to read again (built-in defaults)"
            )
            return
        try:
            reread = load_config(self.cfg.source)
        except ConfigError as exc:
            log.event("reload_failed", logging.ERROR, problem=str(exc), kept="the running config")
            self._reload_problem = str(exc)
            self._publish_status()
            return
        self._reload_problem = None
        cfg, applied, kept = reload.merge(self.cfg, reread)
        for key in kept:
            log.event("reload_kept", logging.WARNING, key=key, reason="cannot change while running; restart")
        self.live.use(cfg)  # every component reads it from here (kernel.core.config.LiveConfig)
        self._feed(sv.Reload(cfg.poll_seconds, cfg.poll_idle_seconds))
        stale, looks, rows = await self.worker.call(self._reapply)
        self._feed(sv.PolicyChanged(tuple(stale)))  # their kernel.json is rewritten in the background
        self._look_at_rows(looks)
        await self._apply_rows(rows)
        self.enroller.soon()  # the new globs' matches, in the background
        log.event(
            "reloaded", config=cfg.source, changed=",".join(applied) or "nothing", kept=",".join(kept) or None
        )
        self._publish_status()

    def _reapply(self) -> tuple[list[str], list[WorkspaceRow], list[WorkspaceRow]]:
        """(a store step) After a reload: give every workspace the policy of the new defaults (new glob matches
        are enrolled after it, in the background: `Enroller.soon`). A channel whose policy changed gets its
        kernel.json rewritten off the store worker: in the channel I/O pool when served (the first list:
        `Refresher.refresh_served`), else by a look (the second). The rows are the third."""
        stale, looks = [], []
        for row in self.store.workspaces():
            policy = enrollment.policy_for(self.store, row.key, self.cfg)
            if policy != row.policy:
                with self.store.transaction():
                    self.store.set_policy(row.key, policy)
                if row.key in self.pipeline.workspaces:
                    stale.append(row.key)
                else:
                    looks.append(dataclasses.replace(row, policy=policy))
        return stale, looks, self.store.workspaces()


def shown(rows: list[WorkspaceRow]) -> sv.Shown:
    """The problems the store shows for these served rows (the serve core clears each once a turn opens the
    channel again)."""
    return sv.Shown(tuple((r.key, r.problem) for r in rows if r.problem is not None))


def helper_children() -> list[int]:
    """This process's children in its own process group: its helpers (git), not its jobs (each job's wrapper
    starts a session of its own, kernel.backends.local)."""
    me, group = os.getpid(), os.getpgrp()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After "pid (comm)": state ppid pgrp ...
        if len(fields) > 2 and int(fields[1]) == me and int(fields[2]) == group:
            found.append(int(entry))
    return found


def arm_stop_deadline(store: Store, deadline_s: float = STOP_DEADLINE_S) -> threading.Thread:
    """After SIGTERM, the process is gone within `deadline_s` whatever it was doing (the orderly stop: start-up
    steps end at the next workspace, a pass finishes, the drain waits for the sleeps in progress; a snapshot of
    a huge tree, an artifact copy or a hung network filesystem can make that take minutes).

    Past the deadline the work still in progress is abandoned, exactly as a SIGKILL would abandon it, which
    every step already survives (tests/fault: SIGKILL at every step, each request answered and each task run
    exactly once): a transaction not committed is rolled back when the store is opened next, and the step is
    redone from the store at the next start. Only a COMMIT in progress is waited for (it is short: the WAL's
    fsync), and no other starts after it (the store's `commit_lock` is kept). The kernel's own helper
    processes (`helper_children`: a snapshot's git) are killed with it, so none goes on writing into a
    kernel-owned repository under the next kernel; jobs run in sessions of their own and go on."""

    def force() -> None:
        time.sleep(deadline_s)
        committing = not store.commit_lock.acquire(timeout=COMMIT_WAIT_S)
        log.event(
            "stop_forced",
            logging.WARNING,
            after_s=deadline_s,
            detail="work in progress abandoned; it is redone at the next start",
            committing=committing or None,
        )
        for pid in helper_children():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for handler in logging.getLogger("syscall-kernel").handlers:
            handler.flush()
        os._exit(0)

    thread = threading.Thread(target=force, name="stop-deadline", daemon=True)
    thread.start()
    return thread


async def _open_store(cfg: Config, notifier: Notifier) -> Store:
    """The store, opened again every STORE_RETRY_S while the disk refuses (full: the WAL cannot be made)."""
    failing = None
    while True:
        try:
            return Store.open(cfg.paths.store)
        except Exception as exc:
            if not disk_failure(exc):
                raise
            if str(exc) != failing:
                failing = str(exc)
                log.event("store_write_failed", logging.ERROR, store=str(cfg.paths.store), error=failing)
            notifier.status(f"degraded (store cannot be opened: {failing}); not serving yet")
            await anyio.sleep(STORE_RETRY_S)


async def serve(
    cfg: Config,
    *,
    executor_factory: ExecutorFactory | None = None,
    publish: Callable[[str], None] | None = None,
) -> None:
    """Run the service; the executor is the config's backend (kernel.service.factory) unless a factory is given.
    `publish` also gets every status line (the state dir lock's note)."""
    live = LiveConfig(cfg)
    if executor_factory is None:
        from kernel.service.factory import executor_factory as configured

        executor_factory = configured(live)
    notifier = Notifier.from_env()
    # The hot path hops between the event loop, the store worker and the channel I/O pool, each hop needing the
    # GIL; while another thread computes (a listing of 100,000 names, an artifact's sha256), each hop could wait
    # a whole switch interval (5 ms by default). 1 ms bounds that wait for a small cost in throughput.
    sys.setswitchinterval(GIL_SWITCH_S)
    # One fd per served channel (its lock, kernel.io.chanlock): the soft limit up to the hard one (LimitNOFILE=).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    store = await _open_store(cfg, notifier)
    try:
        if cfg.metrics_listen:
            try:
                metrics.serve_http(cfg.metrics_listen)
                log.event("metrics_listening", listen=cfg.metrics_listen)
            except OSError as exc:
                # Metrics are optional: the kernel serves without them rather than not at all.
                why = metrics.bind_problem(cfg.metrics_listen) or str(exc)  # who holds the port, if in use
                log.event("metrics_failed", logging.ERROR, listen=cfg.metrics_listen, error=why)

        def deadline() -> None:
            arm_stop_deadline(store)

        svc = Service(
            live, store, notifier, ToolSource.bundled(), executor_factory, publish=publish, on_stop=deadline
        )
        await svc.run()
    finally:
        notifier.close()
        store.close()
