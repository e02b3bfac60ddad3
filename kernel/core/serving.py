"""Every workspace's serving state, as the service sees it: pure (events in, actions out), no I/O, no clock.

The service loop (kernel.service.loop) is a thin driver: it turns what happened (a start-up admission or a look
returned, a look is past its deadline, the operator paused a workspace, a tick of the poll clock, a rescan, a
SIGHUP, SIGTERM) into an event for `Serving.handle`, and runs the actions it gets back (start a look, show or
clear a workspace's problem, re-serve the rows, look at the polled channels now due, refresh the kernel-written
files) in its pools, whose results come back as events. Only the event loop calls `handle`: a pool thread or a
store step never touches this state, it returns what it found and the driver hands that over.

What a workspace's phase is, and why (`phase`; the first that applies):
- `paused`: the operator paused it (`syscall-kernel pause`): its requests wait in its channel.
- `foreign`: its kernel.json names another kernel's store (a take-over): its requests are that kernel's.
- `held elsewhere`: another process holds its channel lock: nothing is written to it until it lets go.
- `overdue`: its admission or look has not returned past the deadline (a hung filesystem); its problem says so.
- `unadmitted` / `looking`: its start-up admission / a running kernel's look at it is in flight.
- `served`: none of those; the service answers it while it also holds the channel's lock.

Invariants, and why they hold:
- At most one look per workspace is in flight (`LookWanted` starts one only when none is), so a hung channel
  holds one thread of the look pool, not one per rescan.
- A workspace is never served while a look or admission of it is in flight (it may find the channel gone,
  taken over or held elsewhere): `served` drops it until `LookDone`.
- The problem an overdue look shows is built here once (`overdue_problem`, shared with the request path's
  turns), shown once, and cleared when the look returns only while it still shows (`ShowProblem.unless`): the
  look's own outcome (a lock held elsewhere) stays.
- After `Stop` no look, refresh or republish starts.
- The polled channels' timing is the pure `PollSchedule` (kernel.core.polling), owned here, and so is the set
  of channels polled rather than watched with inotify (`polled`: what each watch made found); looks start at
  most once per `look_quantum_s`, each start taking every look then due.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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
    watched with inotify, None: none)."""

    key: str
    outcome: Outcome | None
    stale: bool = False
    polled: bool | None = None


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
class Paused:
    """The workspaces the operator has paused now (the store's list)."""

    keys: frozenset[str]


@dataclass(frozen=True, slots=True)
class TakenOver:
    """A served workspace's turn found its kernel.json naming another store."""

    key: str


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
    | Overdue
    | Returned
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
    """Show `problem` as `key`'s (None: clear it, but only while it still shows `unless`)."""

    key: str
    problem: str | None
    unless: str | None = None


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


Action = Look | ShowProblem | Reserve | PollLooks | Refresh | Republish


# --- the state ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Ws:
    look: bool = False  # a look or admission in flight
    admitting: bool = False  # that one is the start-up admission
    overdue: bool = False  # past its deadline
    paused: bool = False
    foreign: bool = False
    held_elsewhere: bool = False
    stale: bool = False  # its kernel-written files wait for a refresh
    # "": nothing to do; "next": to start; "running"; "again": running, and changed again since it started;
    # "failed": its channel failed (tried again at the next rescan).
    republish: str = ""


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
        if ws.held_elsewhere:
            return Phase.HELD_ELSEWHERE
        if ws.look:
            # (An overdue re-watch of a served channel shows its problem and leaves it served.)
            if ws.overdue:
                return Phase.OVERDUE
            return Phase.UNADMITTED if ws.admitting else Phase.LOOKING
        return Phase.SERVED

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
                if ws.look or self.stopping:
                    return []
                ws.look, ws.admitting = True, False
                self._calls[row.key] = row.key
                return [Look(row, ws.paused)]
            case LookTaken(call, key):
                self._calls[call] = key
                return []
            case LookDone(key, outcome, stale, polled):
                self._watched(key, polled)
                return self._look_done(key, outcome, stale)
            case Watched(key, polled):
                self._watched(key, polled)
                return []
            case Unserved(keys):
                self._polled.difference_update(keys)
                return []
            case Overdue(call, since, deadline_s):
                return self._look_overdue(call, since, deadline_s)
            case Returned(call):
                if self._calls.get(call) != call:  # a start-up admission call: it takes no further channel
                    self._calls.pop(call, None)
                got = self._overdue.pop(call, None)
                if got is None:
                    return []
                key, problem = got
                self._get(key).overdue = False
                return [ShowProblem(key, None, unless=problem)]
            case Paused(keys):
                for key in keys:
                    self._get(key).paused = True
                for key, ws in self._ws.items():
                    if ws.paused and key not in keys:
                        ws.paused = False
                return []
            case TakenOver(key):
                self._get(key).foreign = True
                return [Reserve()]
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
                return self._republish()
            case Tick(now):
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

    def _look_done(self, key: str, outcome: Outcome | None, stale: bool) -> list[Action]:
        ws = self._get(key)
        ws.look = ws.admitting = False
        if self._calls.get(key) == key:
            del self._calls[key]
        if outcome is Outcome.SERVED:
            ws.foreign = ws.held_elsewhere = False
            ws.stale = ws.stale or stale
        elif outcome is Outcome.FOREIGN:
            ws.foreign = True
        elif outcome is Outcome.HELD_ELSEWHERE:
            ws.held_elsewhere = True
        if outcome is Outcome.SERVED and not self.stopping:
            return [Reserve()]
        return []

    def _look_overdue(self, call: str, since: str, deadline_s: float) -> list[Action]:
        key = self._calls.get(call)
        if key is None:
            return []
        problem = overdue_problem(since, deadline_s, served=False)
        self._overdue[call] = (key, problem)
        self._get(key).overdue = True
        return [ShowProblem(key, problem)]

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
