"""Every workspace's serving state, as the service sees it: pure (events in, actions out), no I/O, no clock.

The service loop (kernel.service.loop) is a thin driver: it turns what happened (a start-up admission or a look
returned, with what it found; a look, or a served workspace's turn, is past its deadline or returned; a turn
opened its channel or could not; the operator paused or unenrolled a workspace; a tick of the poll clock, a
rescan, a SIGHUP, SIGTERM) into an event for `Serving.handle`, and runs the actions it gets back (start a look,
log, show or clear a workspace's problem, re-serve the rows, look at the polled channels now due, refresh the
kernel-written files) in its pools, whose results come back as events. Only the event loop calls `handle`: a
pool thread or a store step never touches this state, it returns what it found and the driver hands that over.

What a workspace's phase is, and why (`phase`; the first that applies):
- `paused`: the operator paused it (`syscall-kernel pause`): its requests wait in its channel.
- `foreign`: its kernel.json names another kernel's store (a take-over): its requests are that kernel's.
- `held elsewhere`: another process holds its channel lock: nothing is written to it until it lets go.
- `overdue`: its admission or look has not returned past the deadline (a hung filesystem); its problem says so.
- `unadmitted` / `looking`: its start-up admission / a running kernel's look at it is in flight.
- `served`: none of those; the service answers it while it also holds the channel's lock (kernel.service.custody
  holds the locks, and only them).

A workspace's problem (`problem`: what `syscall-kernel status` shows for it, the store's copy written by the
driver on `ShowProblem`) is decided here alone, from what the looks and the turns found: another store owns the
channel, another process holds its lock, a turn could not open or read it, its channel I/O is overdue. A channel
that a look, a refresh or a republish cannot read is logged once per problem and not shown (it is retried at
every rescan): `noted`.

Invariants, and why they hold:
- At most one look per workspace is in flight (`LookWanted` starts one only when none is), so a hung channel
  holds one thread of the look pool, not one per rescan.
- A workspace is never served while a look or admission of it is in flight (it may find the channel gone,
  taken over or held elsewhere): `served` drops it until `LookDone`.
- Each problem is logged once and shown once when it changes (`_show`), and cleared only while it is the one
  shown: an overdue look's or turn's problem when its I/O returns (the look's own outcome, e.g. a lock held
  elsewhere, stays), any other once a turn opens the channel again (`TurnOk`; not while another store owns it
  or another process holds its lock). The overdue message is built here once (`overdue_problem`), for looks and
  turns. A clear carries the problem it clears (`ShowProblem.unless`), so the store's copy is cleared only
  while it still shows that one.
- After `Stop` no look, refresh or republish starts.
- An unenrolled workspace is forgotten (`Unenrolled`): no entry of it is left here or in the poll schedule once
  the look in flight of it, if any, has returned.
- The polled channels' timing is the pure `PollSchedule` (kernel.core.polling), owned here, and so is the set
  of channels polled rather than watched with inotify (`polled`: what each watch made found); looks start at
  most once per `look_quantum_s`, each start taking every look then due.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from channel.messages import StoreRef
from kernel.core.polling import PollSchedule
from kernel.core.records import WorkspaceRow


class Phase(enum.Enum):
    UNADMITTED = "unadmitted"
    LOOKING = "looking"
    SERVED = "served"
    OVERDUE = "overdue"
    PAUSED = "paused"
    FOREIGN = "foreign"
    HELD_ELSEWHERE = "held elsewhere"


class Outcome(enum.Enum):
    """What an admission or look found (the service's `_admit_io`, `_refresh_io`)."""

    SERVED = "served"  # the channel is ours and locked
    FOREIGN = "foreign"  # another kernel's store owns it
    HELD_ELSEWHERE = "held elsewhere"  # another process holds its lock
    PROBLEM = "problem"  # it cannot be opened or read (retried at every rescan)


def overdue_problem(since: str, deadline_s: float, *, served: bool) -> str:
    """The problem of a workspace whose channel I/O has not returned since `since` (a timestamp): `served`, a turn
    of a served workspace (nothing more is started for it); else a look or admission (it is not served)."""
    effect = (
        "nothing more is started for this workspace until it returns"
        if served
        else "this workspace is not served until it returns"
    )
    return (
        f"channel I/O has not returned since {since} (over {deadline_s:g} s: a hung filesystem?); {effect}; "
        "other workspaces are served meanwhile"
    )


def foreign_problem(owner: StoreRef | None) -> str:
    """The problem of a workspace whose kernel.json names another kernel's store `owner` (a take-over)."""
    if owner is None:
        return "owned by another kernel's store; not served here"
    return f"owned by another kernel's store {owner.store} (state_dir {owner.state_dir}); not served here"


# --- events -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitting:
    """The start-up admission of these workspaces begins (each is `unadmitted` until its `LookDone`)."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LookWanted:
    """A store step (a rescan, a reload, a new enrollment, another process's change) asks for a look at `row`."""

    row: WorkspaceRow


@dataclass(frozen=True, slots=True)
class LookTaken:
    """The pool call `call` took `key` (a start-up admission call takes one channel after another)."""

    call: str
    key: str


@dataclass(frozen=True, slots=True)
class LookDone:
    """The look at (or admission of) `key` returned with `outcome`; None: it did not finish (stopping, the store
    could not be written, never taken): not served, looked at again at the next rescan. `stale`: its
    kernel-written files wait for the refresh after `ready`. `polled`: the watch it made (True: polled, False:
    watched with inotify, None: none). Why it is not served: `owner` (FOREIGN: the store its kernel.json names),
    `why` (HELD_ELSEWHERE: who holds the lock; PROBLEM: what could not be opened or read)."""

    key: str
    outcome: Outcome | None
    stale: bool = False
    polled: bool | None = None
    why: str | None = None
    owner: StoreRef | None = None


@dataclass(frozen=True, slots=True)
class Watched:
    """`key`'s requests/ is now polled (`polled`) or watched with inotify (a re-watch, or a channel served
    anew whose filesystem raises no events)."""

    key: str
    polled: bool


@dataclass(frozen=True, slots=True)
class Unserved:
    """These workspaces are no longer served: neither polled nor watched."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Unenrolled:
    """Another process unenrolled these workspaces: forgotten (once a look in flight of one has returned)."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Overdue:
    """The look call `call` is past the deadline (since `since`, a timestamp)."""

    call: str
    since: str
    deadline_s: float


@dataclass(frozen=True, slots=True)
class Returned:
    """The look call `call` returned (after being overdue, or not)."""

    call: str


@dataclass(frozen=True, slots=True)
class TurnOverdue:
    """The channel I/O of served `key` (its turn, an answer's delivery, a refresh, a republish: the request
    path's pool) is past the deadline (since `since`, a timestamp)."""

    key: str
    since: str
    deadline_s: float


@dataclass(frozen=True, slots=True)
class TurnReturned:
    """The overdue channel I/O of `key` in the request path's pool returned."""

    key: str


@dataclass(frozen=True, slots=True)
class TurnOk:
    """A turn of served `key` opened and checked its channel."""

    key: str


@dataclass(frozen=True, slots=True)
class ChannelFailed:
    """Served `key`'s channel cannot be opened or read (`why`): by a turn or an answer's delivery (`shown`: its
    problem until a turn opens it again), or by a refresh or a republish (logged once; tried again)."""

    key: str
    why: str
    shown: bool = True


@dataclass(frozen=True, slots=True)
class Shown:
    """The store shows these problems (`(key, problem)`) for served workspaces (an earlier run's, or one read
    back): each is cleared once a turn opens the channel again (`TurnOk`)."""

    problems: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Paused:
    """The workspaces the operator has paused now (the store's list)."""

    keys: frozenset[str]


@dataclass(frozen=True, slots=True)
class TakenOver:
    """A served workspace's turn or refresh found its kernel.json naming another store, `owner`."""

    key: str
    owner: StoreRef | None = None


@dataclass(frozen=True, slots=True)
class PolicyChanged:
    """A reload changed these served workspaces' policy: their kernel.json is rewritten by the refresh."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BalanceChanged:
    """Another process changed these workspaces' balance: their budget.json is rewritten (republished)."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Republished:
    """A republish of `key` ended; `failed`: its channel failed (tried again at the next rescan)."""

    key: str
    failed: bool = False


@dataclass(frozen=True, slots=True)
class Tick:
    """The clock (the service's monotonic one, in seconds) reads `now`: start the polled channels' looks due."""

    now: float


@dataclass(frozen=True, slots=True)
class Rescan:
    """The periodic rescan: republishes that failed are tried again."""


@dataclass(frozen=True, slots=True)
class Ready:
    """The start is done: refreshes and republishes may run."""


@dataclass(frozen=True, slots=True)
class Reload:
    """A SIGHUP's config is in use: the poll intervals may have changed."""

    poll_s: float
    poll_idle_s: float


@dataclass(frozen=True, slots=True)
class Stop:
    """SIGTERM/SIGINT: nothing new starts."""


Event = (
    Admitting
    | LookWanted
    | LookTaken
    | LookDone
    | Watched
    | Unserved
    | Unenrolled
    | Overdue
    | Returned
    | TurnOverdue
    | TurnReturned
    | TurnOk
    | ChannelFailed
    | Shown
    | Paused
    | TakenOver
    | PolicyChanged
    | BalanceChanged
    | Republished
    | Tick
    | Rescan
    | Ready
    | Reload
    | Stop
)

# --- actions ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Look:
    """Look at `row`'s channel in the look pool (`paused`: do not watch it), then feed back `LookDone`."""

    row: WorkspaceRow
    paused: bool


@dataclass(frozen=True, slots=True)
class ShowProblem:
    """Show `problem` as `key`'s in the store (None: clear it, but only while the store still shows `unless`)."""

    key: str
    problem: str | None
    unless: str | None = None


@dataclass(frozen=True, slots=True)
class Log:
    """Log `event` for workspace `key` (kernel.io.log; `warning`: at WARNING), with `fields`."""

    event: str
    key: str
    warning: bool = False
    fields: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Reserve:
    """Read the rows again and serve those now `served` (a look found a channel ours, a take-over)."""


@dataclass(frozen=True, slots=True)
class PollLooks:
    """Start the polled channels' looks now due (kernel.service.polling.Poller.tick)."""


@dataclass(frozen=True, slots=True)
class Refresh:
    """Rewrite these served channels' kernel-written files (kernel.service.refreshing)."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Republish:
    """Rewrite `key`'s budget.json from the store's balance."""

    key: str


Action = Look | ShowProblem | Log | Reserve | PollLooks | Refresh | Republish


# --- the state ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Ws:
    look: bool = False  # a look or admission in flight
    admitting: bool = False  # that one is the start-up admission
    overdue: bool = False  # past its deadline
    paused: bool = False
    foreign: bool = False
    held_elsewhere: str | None = None  # who holds its lock (another process)
    stale: bool = False  # its kernel-written files wait for a refresh
    # "": nothing to do; "next": to start; "running"; "again": running, and changed again since it started;
    # "failed": its channel failed (tried again at the next rescan).
    republish: str = ""
    problem: str | None = None  # what the store shows (`ShowProblem`)
    turn_overdue: str | None = None  # the problem its overdue channel I/O in the request path shows
    noted: str | None = None  # the channel problem a look, refresh or republish logged (not shown)
    gone: bool = False  # unenrolled while its look was in flight: forgotten once that returns


@dataclass(slots=True)
class Serving:
    """Every workspace's serving state (see the module's docstring); `handle` is the one way to change it."""

    poll_s: float
    poll_idle_s: float
    look_quantum_s: float
    polls: PollSchedule = field(init=False)
    stopping: bool = False
    ready: bool = False
    _ws: dict[str, _Ws] = field(default_factory=dict)
    # Which workspace each look call is on now, and the overdue calls with the workspace and problem they show.
    _calls: dict[str, str] = field(default_factory=dict)
    _overdue: dict[str, tuple[str, str]] = field(default_factory=dict)
    _next_looks: float = 0.0  # the earliest the next batch of polled looks may start
    # The workspaces whose `_Ws.republish` is not "", with it: a republish ending looks at those, not at every
    # workspace.
    _republishing: dict[str, str] = field(default_factory=dict)
    _polled: set[str] = field(default_factory=set)  # the served channels polled rather than watched
    # `_polled` changed since the schedule last followed it (at the next `Tick`: 10,000 keys are not compared at
    # every tick when nothing changed).
    _polled_changed: bool = False

    def __post_init__(self) -> None:
        self.polls = PollSchedule(self.poll_s, max(self.poll_s, self.poll_idle_s))

    def _get(self, key: str) -> _Ws:
        ws = self._ws.get(key)
        if ws is None:
            ws = self._ws[key] = _Ws()
        return ws

    # --- reading -------------------------------------------------------------------------------------------

    def phase(self, key: str) -> Phase:
        ws = self._ws.get(key)
        if ws is None:
            return Phase.SERVED
        if ws.paused:
            return Phase.PAUSED
        if ws.foreign:
            return Phase.FOREIGN
        if ws.held_elsewhere is not None:
            return Phase.HELD_ELSEWHERE
        if ws.look:
            # (An overdue re-watch of a served channel shows its problem and leaves it served.)
            if ws.overdue:
                return Phase.OVERDUE
            return Phase.UNADMITTED if ws.admitting else Phase.LOOKING
        return Phase.SERVED

    def problem(self, key: str) -> str | None:
        """The problem shown for `key` (`syscall-kernel status`), or None."""
        ws = self._ws.get(key)
        return None if ws is None else ws.problem

    def served(self, rows: Iterable[WorkspaceRow], holds: Callable[[str], bool]) -> list[WorkspaceRow]:
        """The rows this kernel answers: in phase `served`, and `holds` their channel lock (so no other kernel
        answers them)."""
        return [r for r in rows if self.phase(r.key) is Phase.SERVED and holds(r.key)]

    def looking(self, key: str) -> bool:
        """Whether an admission or look of `key` is in flight (its channel is not re-watched meanwhile)."""
        ws = self._ws.get(key)
        return ws is not None and ws.look

    def is_stale(self, key: str) -> bool:
        ws = self._ws.get(key)
        return ws is not None and ws.stale

    def is_paused(self, key: str) -> bool:
        ws = self._ws.get(key)
        return ws is not None and ws.paused

    def paused(self) -> frozenset[str]:
        return frozenset(k for k, ws in self._ws.items() if ws.paused)

    def polled(self) -> frozenset[str]:
        """The served channels polled (the poll schedule follows them: `PollSchedule.sync`)."""
        return frozenset(self._polled)

    def is_polled(self, key: str) -> bool:
        return key in self._polled

    def known(self) -> frozenset[str]:
        """Every workspace with an entry here or in the poll schedule (a forgotten one has none)."""
        return frozenset(self._ws) | self._polled | set(self._republishing) | self.polls.keys()

    def look_at(self) -> float | None:
        """When the next polled looks start: the earliest due, but at most once per `look_quantum_s`."""
        due = self.polls.next_at()
        return None if due is None else max(due, self._next_looks)

    # --- events --------------------------------------------------------------------------------------------

    def handle(self, ev: Event) -> list[Action]:
        """Apply `ev`; the actions the driver runs for it, in order."""
        match ev:
            case Admitting(keys):
                for key in keys:
                    ws = self._get(key)
                    ws.look, ws.admitting = True, True
                return []
            case LookWanted(row):
                ws = self._get(row.key)
                ws.gone = False
                if ws.look or self.stopping:
                    return []
                ws.look, ws.admitting = True, False
                self._calls[row.key] = row.key
                return [Look(row, ws.paused)]
            case LookTaken(call, key):
                self._calls[call] = key
                return []
            case LookDone():
                return self._look_done(ev)
            case Watched(key, polled):
                self._watched(key, polled)
                return []
            case Unserved(keys):
                self._polled.difference_update(keys)
                self._polled_changed = True
                return []
            case Unenrolled(keys):
                for key in keys:
                    self._unenrolled(key)
                return []
            case Overdue(call, since, deadline_s):
                return self._look_overdue(call, since, deadline_s)
            case Returned(call):
                return self._look_returned(call)
            case TurnOverdue(key, since, deadline_s):
                ws = self._get(key)
                ws.turn_overdue = overdue_problem(since, deadline_s, served=True)
                return self._set_problem(key, ws, ws.turn_overdue)
            case TurnReturned(key):
                return self._turn_returned(key)
            case TurnOk(key):
                return self._turn_ok(key)
            case ChannelFailed(key, why, shown):
                ws = self._get(key)
                return self._set_problem(key, ws, why) if shown else self._note(key, ws, why)
            case Shown(problems):
                for key, problem in problems:
                    ws = self._get(key)
                    if ws.problem is None:
                        ws.problem = problem
                return []
            case Paused(keys):
                for key in keys:
                    self._get(key).paused = True
                for key, ws in self._ws.items():
                    if ws.paused and key not in keys:
                        ws.paused = False
                return []
            case TakenOver(key, owner):
                return [*self._foreign(key, self._get(key), owner), Reserve()]
            case PolicyChanged(keys):
                for key in keys:
                    self._get(key).stale = True
                return self._refresh()
            case BalanceChanged(keys):
                for key in keys:
                    ws = self._get(key)
                    if ws.republish in ("running", "again"):
                        self._set_republish(key, ws, "again")
                    else:
                        self._set_republish(key, ws, "next")
                return self._republish()
            case Republished(key, failed):
                ws = self._get(key)
                if ws.republish == "again":
                    self._set_republish(key, ws, "next")
                else:
                    self._set_republish(key, ws, "failed" if failed else "")
                out = self._republish()
                self._prune(key)
                return out
            case Tick(now):
                if self._polled_changed:
                    self._polled_changed = False
                    self.polls.sync(set(self._polled), now)
                look_at = self.look_at()
                if self.stopping or look_at is None or look_at > now:
                    return []
                self._next_looks = now + self.look_quantum_s
                return [PollLooks()]
            case Rescan():
                for key in [k for k, v in self._republishing.items() if v == "failed"]:
                    self._set_republish(key, self._ws[key], "next")
                return self._republish()
            case Ready():
                self.ready = True
                if self.stopping:
                    return []
                return [Refresh(self.take_stale()), *self._republish()]  # (the refresh logs even none)
            case Reload(poll_s, poll_idle_s):
                self.poll_s, self.poll_idle_s = poll_s, poll_idle_s
                self.polls.base_s, self.polls.idle_max_s = poll_s, max(poll_s, poll_idle_s)
                return self._refresh()
            case Stop():
                self.stopping = True
                return []
        raise TypeError(f"not a serving event: {ev!r}")

    def take_stale(self) -> tuple[str, ...]:
        """The keys whose kernel-written files wait for a refresh, now taken (each is refreshed once)."""
        keys = tuple(sorted(k for k, ws in self._ws.items() if ws.stale))
        for key in keys:
            self._ws[key].stale = False
        return keys

    def _watched(self, key: str, polled: bool | None) -> None:
        if polled:
            self._polled.add(key)
        elif polled is not None:
            self._polled.discard(key)
        self._polled_changed = True

    def _look_done(self, ev: LookDone) -> list[Action]:
        key, outcome = ev.key, ev.outcome
        ws = self._get(key)
        if self._calls.get(key) == key:
            del self._calls[key]
        if ws.gone:  # unenrolled meanwhile: what it found is nobody's
            self._forget(key)
            return []
        self._watched(key, ev.polled)
        ws.look = ws.admitting = False
        out: list[Action] = []
        if outcome is Outcome.SERVED:
            ws.foreign, ws.noted = False, None
            if ws.held_elsewhere is not None:
                ws.held_elsewhere = None
                out += [Log("channel_lock_taken", key), *self._show(key, ws, None)]
            ws.stale = ws.stale or ev.stale
            if not self.stopping:
                out.append(Reserve())
        elif outcome is Outcome.FOREIGN:
            out += self._foreign(key, ws, ev.owner)
        elif outcome is Outcome.HELD_ELSEWHERE:
            why = ev.why or "another process holds the channel's lock"
            if ws.held_elsewhere != why:
                ws.held_elsewhere = why
                out += [
                    Log("channel_held_elsewhere", key, warning=True, fields=(("problem", why),)),
                    *self._show(key, ws, why),
                ]
        elif outcome is Outcome.PROBLEM:
            out += self._note(key, ws, ev.why or "the channel cannot be opened or read")
        self._prune(key)
        return out

    def _turn_returned(self, key: str) -> list[Action]:
        """The overdue channel I/O of `key`'s turn returned: its problem is cleared while it still shows."""
        out: list[Action] = [Log("channel_io_returned", key)]
        ws = self._ws.get(key)
        if ws is None or ws.turn_overdue is None:
            return out
        problem, ws.turn_overdue = ws.turn_overdue, None
        if ws.problem == problem:
            out += [Log("channel_ok", key), *self._show(key, ws, None)]
        self._prune(key)
        return out

    def _turn_ok(self, key: str) -> list[Action]:
        """A turn opened and checked `key`'s channel: the problem it shows is cleared, unless a look of it is
        overdue (cleared when it returns) or the channel is another store's or its lock another process's (a
        turn that ran as that was found)."""
        ws = self._ws.get(key)
        if ws is None or ws.problem is None or ws.overdue or ws.foreign or ws.held_elsewhere is not None:
            return []
        out = [Log("channel_ok", key), *self._show(key, ws, None)]
        self._prune(key)
        return out

    def _foreign(self, key: str, ws: _Ws, owner: StoreRef | None) -> list[Action]:
        """Another kernel's store (`owner`, when known) owns `key`'s channel: logged and shown once."""
        if ws.foreign:
            return []
        ws.foreign = True
        fields = () if owner is None else (("store", owner.store), ("state_dir", owner.state_dir))
        return [
            Log("channel_owned_elsewhere", key, warning=True, fields=fields),
            *self._show(key, ws, foreign_problem(owner)),
        ]

    def _set_problem(self, key: str, ws: _Ws, problem: str) -> list[Action]:
        """`problem` is `key`'s now: logged and shown once."""
        if ws.problem == problem:
            return []
        return [
            Log("channel_problem", key, warning=True, fields=(("problem", problem),)),
            *self._show(key, ws, problem),
        ]

    def _note(self, key: str, ws: _Ws, problem: str) -> list[Action]:
        """A channel problem that is retried (a look's, a refresh's, a republish's): logged once, not shown."""
        if ws.noted == problem:
            return []
        ws.noted = problem
        return [Log("channel_problem", key, warning=True, fields=(("problem", problem),))]

    def _show(self, key: str, ws: _Ws, problem: str | None) -> list[Action]:
        """Show `problem` (None: clear the one shown) in the store, if it changes what is shown."""
        shown = ws.problem
        if shown == problem:
            return []
        ws.problem = problem
        return [ShowProblem(key, problem, unless=shown if problem is None else None)]

    def _look_overdue(self, call: str, since: str, deadline_s: float) -> list[Action]:
        key = self._calls.get(call)
        if key is None or (key in self._ws and self._ws[key].gone):
            return []
        ws = self._get(key)
        problem = overdue_problem(since, deadline_s, served=False)
        self._overdue[call] = (key, problem)
        ws.overdue = True
        return [
            Log("channel_problem", key, warning=True, fields=(("problem", problem),)),
            *self._show(key, ws, problem),
        ]

    def _look_returned(self, call: str) -> list[Action]:
        # An admission call takes no further channel, a re-watch is done; a look's entry goes at its `LookDone`.
        on = self._calls.get(call)
        if on is not None and (on != call or not self.looking(on)):
            del self._calls[call]
        got = self._overdue.pop(call, None)
        if got is None:
            return []
        key, problem = got
        ws = self._ws.get(key)
        out: list[Action] = [Log("channel_io_returned", key)]
        if ws is None:
            return out
        ws.overdue = False
        if ws.problem == problem:
            out += self._show(key, ws, None)
        self._prune(key)
        return out

    def _prune(self, key: str) -> None:
        """Drop `key`'s entry once it says nothing an absent one does not (served, no problem, nothing pending)."""
        if self._ws.get(key) == _Ws():
            del self._ws[key]

    def _unenrolled(self, key: str) -> None:
        self._polled.discard(key)
        self._republishing.pop(key, None)
        self.polls.forget(key)
        ws = self._ws.get(key)
        if ws is not None and ws.look:
            # Its look returns later (`LookDone`): forgotten then. Until then it is not served (looking).
            self._ws[key] = _Ws(look=True, admitting=ws.admitting, overdue=ws.overdue, gone=True)
        else:
            self._forget(key)

    def _forget(self, key: str) -> None:
        self._ws.pop(key, None)
        self._polled.discard(key)
        self._republishing.pop(key, None)
        self.polls.forget(key)
        # (An overdue call on it keeps its entry until it returns: `Returned`.)
        for call in [c for c, k in self._calls.items() if k == key and c not in self._overdue]:
            del self._calls[call]

    def _refresh(self) -> list[Action]:
        if not self.ready or self.stopping:
            return []
        keys = self.take_stale()
        return [Refresh(keys)] if keys else []

    def _set_republish(self, key: str, ws: _Ws, state: str) -> None:
        ws.republish = state
        if state:
            self._republishing[key] = state
        else:
            self._republishing.pop(key, None)

    def _republish(self) -> list[Action]:
        if not self.ready or self.stopping:
            return []
        out: list[Action] = []
        for key in sorted(k for k, v in self._republishing.items() if v == "next"):
            self._set_republish(key, self._ws[key], "running")
            out.append(Republish(key))
        return out
