"""The enrollment of the `workspaces` globs' new matches, in rounds, off the store worker: `Enroller`.

A round (`Enroller.enroll`) expands each glob, prepares each new match's channel (checked, made, its files
written, its lock taken: `kernel.io.enroll.prepare_new`) and records the prepared ones in glob order, a batch at
a time: one sync of each filesystem among them, then one store step that commits their rows. Every call that can
touch a workspace's filesystem (a glob, a preparation, a sync) runs in the service's channel look pool (the
`ChannelIO` it is given), waited for at most `channel_io_deadline_seconds`. The start's round runs before the
admission; later ones (`Enroller.soon`: each rescan, each SIGHUP, each hung call that returned) run in the
background after `ready`, one at a time.

Invariants, and why they hold:
- Each workspace is enrolled exactly once and store writes stay on the one writer: rows are committed only in
  store steps (`_commit`, after the sync of their filesystem returned, so a committed row means durable channel
  files), and a path already enrolled (`_enrollment_facts`) is never prepared again.
- A hung filesystem delays only the enrollment of what lies on it: a glob, a new path or a sync past the deadline
  is left to its thread, not tried again until it returns (`_hung_globs`, `_hung_paths`, `_hung_syncs`), and its
  outcome is then recorded by a later round (`_late_matches`, `_late`). Meanwhile `degraded` says what waits.
- Owns its state alone: the round, the hung and late bookkeeping, the refusals logged. All of it is touched on the
  event loop only, except a `_Round`'s fields that its `mutex` guards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel

from kernel.core.config import Config, LiveConfig
from kernel.io import crash, log
from kernel.io import enroll as enrollment
from kernel.io.install import ToolSource
from kernel.io.store import StoreUnavailable, StoreWorker, timestamp
from kernel.io.watch import read_mounts
from kernel.service.chanio import OVERDUE_MAX, ChannelIO, ChannelIOAbandoned, timed_afresh

# New channels prepared at a time during enrollment (file I/O, and a git process for an index that cannot be
# read directly): enough to overlap I/O on a few cores without flooding the machine. Each is a call in the
# channel look pool taking the next new path in turn (`Enroller._prepare_from`), so the event loop hops once per
# call and chunk, not once per workspace (10,000 of them at a first start).
ENROLL_WORKERS = 4
# New workspaces recorded per sync + transaction (a sync writes ~150 KB per channel, mostly the tool).
ENROLL_BATCH = 256
T = TypeVar("T")

Mounts = list[tuple[str, str]]
Outcome = enrollment.Prepared | enrollment.EnrollError


@dataclasses.dataclass(slots=True, eq=False)
class _Round:
    """One enrollment of new glob matches (`Enroller.enroll`), shared by its preparation calls in the
    channel look pool. `mutex` guards `next`, `at`, `got`, `hung`, `left` and `closed`: the calls' threads and the
    loop both use them."""

    paths: list[str]  # the new matches, in glob order
    facts: enrollment.NewFacts
    cfg: Config
    mounts: Mounts
    token: anyio.lowlevel.EventLoopToken
    # Prepared by an earlier round and not recorded yet (its sync had not returned): recorded without preparing.
    ready: dict[str, enrollment.Prepared]
    got: list[Outcome | None]  # by index; None while not prepared, and for good when overdue
    # Per chunk of ENROLL_BATCH paths: how many are neither prepared, refused nor overdue; set once none is.
    left: list[int]
    settled: list[anyio.Event]
    mutex: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    next: int = 0
    at: dict[str, int] = dataclasses.field(default_factory=dict)  # call -> the index it prepares now
    hung: set[int] = dataclasses.field(default_factory=set)  # indices overdue: the round goes on without them
    overdue: set[str] = dataclasses.field(default_factory=set)  # calls past the deadline
    closed: bool = False

    def settle(self, i: int) -> anyio.Event | None:
        """(under `mutex`) Index `i` is done with; the event to set when that completes its chunk."""
        chunk = i // ENROLL_BATCH
        self.left[chunk] -= 1
        return self.settled[chunk] if self.left[chunk] == 0 else None

    def close(self) -> list[anyio.Event]:
        """(under `mutex`) Take no further path: the untaken ones are left to a later round; the events to set."""
        events = [e for i in range(self.next, len(self.paths)) if (e := self.settle(i)) is not None]
        self.next = len(self.paths)
        self.closed = True
        return events


@dataclasses.dataclass(slots=True, eq=False)
class _Bounded:
    """A call in the channel look pool whose caller waits for it at most the deadline (`Enroller._bounded`)."""

    settled: anyio.Event
    on_overdue: Callable[[float], None]
    returned: bool = False
    value: object = None
    overdue: bool = False


class Enroller:
    """Enrolls the globs' new matches in rounds (one at a time), in the channel look pool `looks`; owns the
    rounds, the hung-filesystem bookkeeping (what waits: `degraded`) and the refusals it logged.

    The service gives it what it needs: the live config (each round takes it as the round begins), the store
    worker, the look pool (whose overdue calls it is asked about first: `overdue`), the tool, `claim` (takes a
    new channel's lock), `stopping`, `ready` (later rounds wait for it) and `on_enrolled` (what the service does
    with the keys a later round enrolled); `tg`, the service's task group, once it runs."""

    def __init__(
        self,
        live: LiveConfig,
        worker: StoreWorker,
        looks: ChannelIO,
        tool: ToolSource,
        *,
        claim: enrollment.Claim,
        stopping: Callable[[], bool],
        ready: anyio.Event,
        on_enrolled: Callable[[list[str]], Awaitable[None]],
    ) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.looks = looks
        self.tool = tool
        self.claim = claim
        self.stopping = stopping
        self.ready = ready
        self.on_enrolled = on_enrolled
        self.tg: anyio.abc.TaskGroup | None = None  # the service's (`attach`): later rounds run there
        # Glob matches refused (with why): logged once per path and reason.
        self._refused: dict[str, str] = {}
        # One round at a time, the start's before the admission and later ones by `_enroller`. What a round left
        # past the deadline (a hung filesystem) is not tried again until it returns; then its outcome waits here
        # for the next round.
        self._round: _Round | None = None
        self._preparing: dict[str, _Round] = {}  # preparation call -> its round
        self._calls = 0  # look-pool call names are never reused: a hung call keeps its name's turn
        self._bounded_calls: dict[str, _Bounded] = {}
        self._enroll_wanted = False
        self._enroller_running = False
        self._hung_globs: set[str] = set()
        self._late_matches: dict[str, tuple[list[str], Mounts]] = {}
        self._hung_paths: set[str] = set()
        self._hung_syncs: dict[int, str] = {}  # filesystem (st_dev) -> what `_enroll_waits` calls its sync
        self._late: dict[str, enrollment.Prepared] = {}
        # What enrollment waits for (a glob, a new path, a filesystem's sync) -> since when: `degraded` says so.
        self._enroll_waits: dict[str, str] = {}

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    def degraded(self) -> str | None:
        """What the enrollment waits for (a hung filesystem), or None."""
        if not self._enroll_waits:
            return None
        (what, since), more = next(iter(self._enroll_waits.items())), len(self._enroll_waits) - 1
        return (
            f"enrollment of new glob matches waits for a hung filesystem: {what} has not returned since {since}"
            + (f" (and {more} more)" if more else "")
            + "; enrolled workspaces are served meanwhile"
        )

    async def enroll(self) -> list[str]:
        """Enroll the new directories the `workspaces` globs match (at start; then at every rescan and SIGHUP,
        through `soon`); a refusal is logged once per path and reason. Returns the keys enrolled.

        No step here holds the store worker for a workspace's filesystem, nor waits for one past
        `channel_io_deadline_seconds`: each glob is expanded in the channel look pool (`_bounded`, one call per
        pattern); each new path's channel is prepared there (checked, made, its files written without an fsync
        each, its lock taken: `enrollment.prepare_new`, no store) by ENROLL_WORKERS calls taking the paths in
        turn (`_prepare_from`); the prepared channels are recorded in glob order, ENROLL_BATCH at a time: one
        sync of each filesystem among them, in the look pool too, then one store step that commits all their rows
        (`enrollment.record_new`: the sync has returned, so a committed row means durable channel files). So each
        workspace is enrolled exactly once and store writes stay on the one writer. The submit base is left
        pending for the executor (after serving).
        A glob, a preparation or a sync past the deadline (a hung filesystem) is left to its thread and logged
        once (`degraded` says so meanwhile); the round goes on without what it holds (that glob's matches, that
        path, that filesystem's channels of the batch), which is not tried again until it returns and is then
        enrolled by a later round (`soon`). So a hung filesystem delays only the enrollment of what lies
        on it: neither `ready` nor any enrolled workspace's answers wait for it.
        SIGTERM: nothing more is recorded; preparations not begun are not begun (one running is a few file
        writes, or one git process when the index cannot be read directly); the channels prepared but not
        recorded are prepared again, and recorded, at the next start."""
        matches, mounts = await self._expand_globs(self.cfg.workspaces)
        if self.stopping() or not (matches or self._late):
            return []
        known, facts = await self.worker.call(self._enrollment_facts, [*matches, *self._late])
        for path in [p for p in self._late if p in known]:  # enrolled meanwhile (an operator's `enroll`)
            del self._late[path]
        new = [p for p in matches if p not in known and p not in self._hung_paths]
        listed = set(new)
        new += sorted(p for p in self._late if p not in listed)
        if not new or facts is None or self.stopping():
            return []
        if isinstance(facts, enrollment.EnrollError):
            log.event("enroll_refused", logging.WARNING, path=",".join(new[:3]), reason=log.Whole(facts))
            return []
        chunks = range(0, len(new), ENROLL_BATCH)
        rnd = _Round(
            paths=new,
            facts=facts,
            cfg=self.cfg,
            mounts=mounts,
            token=anyio.lowlevel.current_token(),
            ready={p: self._late.pop(p) for p in new if p in self._late},
            got=[None] * len(new),
            left=[min(ENROLL_BATCH, len(new) - start) for start in chunks],
            settled=[anyio.Event() for _ in chunks],
        )
        self._round = rnd
        enrolled: list[str] = []
        try:
            for _ in range(min(ENROLL_WORKERS, len(new))):
                self._start_preparer(rnd)
            for chunk, start in enumerate(chunks):
                await rnd.settled[chunk].wait()
                if self.stopping():  # SIGTERM: the rest waits for the next start
                    break
                batch = []
                for path, got in zip(new[start : start + ENROLL_BATCH], rnd.got[start:], strict=False):
                    if isinstance(got, enrollment.EnrollError):
                        if self._refused.get(path) != str(got):
                            self._refused[path] = str(got)
                            log.event("enroll_refused", logging.WARNING, path=path, reason=log.Whole(got))
                    elif got is not None:  # None: overdue, enrolled by a later round once it returns
                        batch.append(got)
                if batch:
                    enrolled += await self._record(batch)
        finally:
            with rnd.mutex:
                rnd.close()
            self._round = None
        return enrolled

    def _enrollment_facts(
        self, paths: list[str]
    ) -> tuple[set[str], enrollment.NewFacts | enrollment.EnrollError | None]:
        """(a store step) Which of `paths` are enrolled; when any is not, what preparing it needs (or why the store
        refuses)."""
        known = self.store.workspace_paths()
        enrolled = {p for p in paths if p in known}
        if len(enrolled) == len(set(paths)):
            return enrolled, None
        try:
            return enrolled, enrollment.new_facts(self.store)
        except enrollment.EnrollError as exc:
            return enrolled, exc

    async def _expand_globs(self, patterns: tuple[str, ...]) -> tuple[list[str], Mounts]:
        """The matches of the globs that return within the deadline (one look-pool call each, `_expand_io`), or
        returned late since the last round, resolved, deduplicated and sorted; and the mount table. A glob still
        hung is skipped."""
        found: dict[str, tuple[list[str], Mounts]] = {}

        async def expand(pattern: str) -> None:
            returned, got = await self._bounded(
                f"glob {pattern}",
                partial(self._glob_overdue, pattern),
                partial(self._glob_returned, pattern),
                self._expand_io,
                pattern,
            )
            if returned:
                found[pattern] = got  # type: ignore[assignment]

        patterns = tuple(dict.fromkeys(patterns))
        for pattern in [p for p in self._late_matches if p not in patterns]:  # no longer configured
            del self._late_matches[pattern]
        async with anyio.create_task_group() as tg:
            for pattern in patterns:
                if pattern in self._late_matches:
                    found[pattern] = self._late_matches.pop(pattern)
                elif pattern not in self._hung_globs:
                    tg.start_soon(expand, pattern)
        matches = sorted({path for paths, _ in found.values() for path in paths})
        return matches, next((mounts for _, mounts in found.values()), [])

    def _expand_io(self, pattern: str) -> tuple[list[str], Mounts]:
        """(channel look pool) One glob's matches (its directory may be on a hung filesystem), and the mounts."""
        crash.hang_point("glob", pattern)
        return enrollment.expand_globs((pattern,)), read_mounts()

    def _glob_overdue(self, pattern: str, since: float) -> None:
        self._hung_globs.add(pattern)
        self._enroll_waits[f"glob {pattern}"] = timestamp(since)
        log.event(
            "glob_overdue",
            logging.WARNING,
            glob=pattern,
            since=timestamp(since),
            problem=f"the glob has not returned after {self.looks.deadline:g} s (a hung filesystem?); its new "
            "matches are enrolled once it returns; enrolled workspaces are served meanwhile",
        )

    def _glob_returned(self, pattern: str, got: object) -> None:
        self._hung_globs.discard(pattern)
        self._enroll_waits.pop(f"glob {pattern}", None)
        log.event("glob_returned", glob=pattern)
        if isinstance(got, tuple):
            self._late_matches[pattern] = got
        self.soon()

    def _start_preparer(self, rnd: _Round) -> None:
        assert self.tg is not None
        self._calls += 1
        call = f"enrollment {self._calls}"
        self._preparing[call] = rnd
        self.tg.start_soon(self._preparer, rnd, call)

    async def _preparer(self, rnd: _Round, call: str) -> None:
        try:
            late = await self.looks.run(call, self._prepare_from, call, rnd)
        except ChannelIOAbandoned:
            return
        finally:
            self._preparing.pop(call, None)
        if late is not None:  # the path it was on when overdue returned: a later round records it
            path, got = late
            self._hung_paths.discard(path)
            self._enroll_waits.pop(f"new match {path}", None)
            log.event("enroll_io_returned", path=path)
            if isinstance(got, enrollment.Prepared):
                self._late[path] = got
            self.soon()

    def _prepare_from(self, call: str, rnd: _Round) -> tuple[str, Outcome] | None:
        """(channel look pool) Prepare the round's next new path until none is left (or SIGTERM); each is timed
        afresh. Past the deadline on one path the round goes on without it (`_prepare_overdue`) and this call
        takes no further path: returns that path and its outcome, for a later round."""
        while not self.stopping():
            with rnd.mutex:
                if rnd.closed or call in rnd.overdue or rnd.next >= len(rnd.paths):
                    return None
                i = rnd.next
                rnd.next += 1
                rnd.at[call] = i
            path = rnd.paths[i]
            timed_afresh()
            got = rnd.ready.get(path) or self._prepare(rnd, path)
            with rnd.mutex:
                del rnd.at[call]
                if i in rnd.hung:
                    return path, got
                rnd.got[i] = got
                settled = rnd.settle(i)
            if settled is not None:
                with contextlib.suppress(RuntimeError):  # the loop is gone (the process is exiting)
                    anyio.from_thread.run_sync(settled.set, token=rnd.token)
        return None

    def _prepare(self, rnd: _Round, path: str) -> Outcome:
        crash.hang_point("prepare", path)
        try:
            return enrollment.prepare_new(
                rnd.facts, rnd.cfg, path, self.tool, mounts=rnd.mounts, claim=self.claim
            )
        except enrollment.EnrollError as exc:
            return exc
        except OSError as exc:  # e.g. the disk is full: tried again at the next rescan
            return enrollment.EnrollError(f"{path}: the channel cannot be made: {exc}")

    def _prepare_overdue(self, rnd: _Round, call: str, since: float) -> None:
        """A preparation call past the deadline on one new path: the round goes on without that path (logged
        once; not tried again until it returns), and another call takes the paths left."""
        with rnd.mutex:
            i = rnd.at.get(call)
            if i is None:  # between two paths: it goes on with the next
                return
            rnd.overdue.add(call)
            rnd.hung.add(i)
            settled = [e for e in (rnd.settle(i),) if e is not None]
            if len(rnd.overdue) >= OVERDUE_MAX:  # a whole filesystem hung: the rest waits for a later round
                settled += rnd.close()
            start = not rnd.closed and rnd.next < len(rnd.paths) and not self.stopping()
        path = rnd.paths[i]
        self._hung_paths.add(path)
        self._enroll_waits[f"new match {path}"] = timestamp(since)
        log.event(
            "enroll_overdue",
            logging.WARNING,
            path=path,
            since=timestamp(since),
            problem=f"its channel has not been made after {self.looks.deadline:g} s (a hung filesystem?); it is "
            "enrolled once that returns; the other new matches are enrolled meanwhile",
        )
        for event in settled:
            event.set()
        if start:
            self._start_preparer(rnd)

    async def _record(self, batch: list[enrollment.Prepared]) -> list[str]:
        """Sync each filesystem among `batch` (in the look pool, `_bounded`), then commit the rows of the channels
        whose filesystem was synced (a store step); those on a filesystem whose sync is overdue wait for a later
        round (and sync again there). The keys recorded."""
        synced = set()
        for dev, path in enrollment.filesystems_of(batch).items():
            if dev in self._hung_syncs:
                continue
            returned, problem = await self._bounded(
                f"sync {dev}",
                partial(self._sync_overdue, dev, path),
                partial(self._sync_returned, dev),
                self._sync_io,
                path,
            )
            if returned and problem is None:
                synced.add(dev)
            elif returned:  # those channels are prepared again at the next round
                log.event("enroll_sync_failed", logging.WARNING, path=path, problem=problem)
        if self.stopping():
            return []
        ready = [p for p in batch if p.dev in synced]
        for p in batch:
            if p.dev in self._hung_syncs:
                self._late[p.row.path] = p
        if ready:
            await self.worker.call(self._commit, ready)
        return [p.row.key for p in ready]

    def _sync_io(self, path: str) -> str | None:
        """(channel look pool) Sync the filesystem holding `path`; what failed, or None."""
        crash.hang_point("sync", path)
        try:
            enrollment.sync_workspace_fs(path)
        except OSError as exc:
            return f"the filesystem could not be synced: {exc}"
        return None

    def _sync_overdue(self, dev: int, path: str, since: float) -> None:
        what = self._hung_syncs[dev] = f"the sync of the filesystem of {path}"
        self._enroll_waits[what] = timestamp(since)
        log.event(
            "enroll_sync_overdue",
            logging.WARNING,
            path=path,
            since=timestamp(since),
            problem=f"the sync of its filesystem has not returned after {self.looks.deadline:g} s (a hung "
            "filesystem?); the new matches on it are enrolled once it returns",
        )

    def _sync_returned(self, dev: int, got: object) -> None:
        self._enroll_waits.pop(self._hung_syncs.pop(dev, ""), None)
        log.event("enroll_sync_returned", dev=dev)
        self.soon()

    def _commit(self, batch: list[enrollment.Prepared]) -> None:
        """(a store step) Record a synced batch (`enrollment.record_new`)."""
        enrollment.record_new(self.store, batch)
        for p in batch:
            log.event("enrolled", ws=p.row.key, path=p.row.path, watch=p.row.watch)
            self._refused.pop(p.row.path, None)

    async def _bounded(
        self,
        call: str,
        on_overdue: Callable[[float], None],
        late: Callable[[object], None],
        fn: Callable[..., T],
        *args: object,
    ) -> tuple[bool, T | None]:
        """`fn(*args)` in the channel look pool, waited for at most the deadline: (True, its value) when it
        returns in time, else (False, None) once it is overdue (`on_overdue(since)`, from `overdue`) or
        the kernel stops. An overdue call's outcome (its value, or the exception it raised) goes to `late` when it
        returns. Not for a workspace's channel: nothing here holds a workspace or shows its problem."""
        assert self.tg is not None
        box = _Bounded(anyio.Event(), on_overdue)
        self._bounded_calls[call] = box

        async def run() -> None:
            try:
                try:
                    value: object = await self.looks.run(call, fn, *args)
                except ChannelIOAbandoned:
                    return
                except Exception as exc:
                    value = exc
                if box.overdue:
                    late(value)
                else:
                    box.returned, box.value = True, value
            finally:
                self._bounded_calls.pop(call, None)
                box.settled.set()

        self.tg.start_soon(run)
        await box.settled.wait()
        if isinstance(box.value, Exception):
            raise box.value
        return box.returned, box.value  # type: ignore[return-value]

    def soon(self) -> None:
        """Have the globs' new matches enrolled by the `_enroller` (after `ready`; one round at a time)."""
        self._enroll_wanted = True
        if not self._enroller_running and self.tg is not None and not self.stopping():
            self._enroller_running = True
            self.tg.start_soon(self._enroller)

    async def _enroller(self) -> None:
        """The running kernel's enrollment: a round (`enroll`) while one is wanted; the keys each round enrolled
        go to `on_enrolled` (the service looks at each such workspace and then serves it)."""
        try:
            await self.ready.wait()
            while self._enroll_wanted and not self.stopping():
                self._enroll_wanted = False
                enrolled = await self.enroll()
                if enrolled and not self.stopping():
                    await self.on_enrolled(enrolled)
        except StoreUnavailable:
            pass  # the store cannot be written (`degraded` says so): the next rescan enrolls them
        finally:
            self._enroller_running = False

    def overdue(self, call: str, since: float) -> bool:
        """A look-pool call past the deadline: whether it is one of the enrollment's (a glob, a new path, a
        sync), which has no workspace yet: its round goes on without it (`_bounded`, `_prepare_overdue`)."""
        box = self._bounded_calls.get(call)
        if box is not None:
            box.overdue = True
            box.on_overdue(since)
            box.settled.set()
            return True
        rnd = self._preparing.get(call)
        if rnd is not None:
            self._prepare_overdue(rnd, call, since)
            return True
        return False

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        """The running service's task group: the rounds after the start's run there (`soon`)."""
        self.tg = tg

    def stop(self) -> None:
        """SIGTERM: whatever waits for a call of the enrollment goes on (and records nothing more)."""
        for box in list(self._bounded_calls.values()):
            box.settled.set()
        if self._round is not None:
            for event in self._round.settled:
                event.set()
