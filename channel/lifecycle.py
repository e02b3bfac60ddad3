"""The lifecycle of a sleep and of its tasks, as transition tables.

Every state change in the kernel goes through `next_sleep_state` / `next_task_state`; a transition not in the
table raises `IllegalTransition` (a kernel bug, never the agent's fault). The spec's state tables are generated
from `SLEEP_TRANSITIONS` and `TASK_TRANSITIONS`.

A sleep moves received -> validated -> snapshotted -> submitted -> running -> gathered -> woken. Every cheap
refusal happens before every expensive step, so `rejected` is reachable only from the first three states. A sleep
answered before its environment was built whose build then fails goes from snapshotted to gathered (its tasks
never submitted) and wakes with the error.
A task moves PENDING -> RUNNING -> a terminal state; `cancel` and scheduler verdicts may end it from either.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, get_args

# The one list of each kind of state (the protocol's Literals)
from channel.messages import SleepState, TaskState


class SleepEvent(StrEnum):
    VALIDATE = "validate"  # decoded, within policy and budget; charged
    REJECT = "reject"  # refused; nothing charged, nothing run
    SNAPSHOT = "snapshot"  # the workspace's tree is committed under a kernel ref
    SUBMIT = "submit"  # every task was handed to the backend (job ids recorded)
    START = "start"  # the first task began running
    GATHER = "gather"  # every task is terminal; results collected, artifacts delivered
    WAKE = "wake"  # the wake files are written and the budget refunded
    # The sleep's `wake_on` was met while tasks still ran (`rest` "run"): the ended tasks gathered and the early
    # wake recorded; then its files written. The rest goes on to `gather` and `wake` as any sleep's.
    GATHER_EARLY = "gather_early"
    WAKE_EARLY = "wake_early"


class TaskEvent(StrEnum):
    START = "start"
    FINISH = "finish"  # ended on its own: COMPLETED, FAILED, TIMEOUT, OUT_OF_MEMORY
    CANCEL = "cancel"  # cancelled by the agent or the kernel
    LOSE = "lose"  # the scheduler says NODE_FAIL, PREEMPTED or the job vanished
    SKIP = (
        "skip"  # a submit's evaluation run the kernel decided not to run (REUSED or SKIPPED), before dispatch
    )


SLEEP_TRANSITIONS: Final[dict[tuple[SleepState, SleepEvent], SleepState]] = {
    ("received", SleepEvent.VALIDATE): "validated",
    ("received", SleepEvent.REJECT): "rejected",
    ("validated", SleepEvent.SNAPSHOT): "snapshotted",
    ("validated", SleepEvent.REJECT): "rejected",
    ("snapshotted", SleepEvent.SUBMIT): "submitted",
    ("snapshotted", SleepEvent.REJECT): "rejected",
    ("submitted", SleepEvent.START): "running",
    # every task may end before the kernel sees any of them run (a checkpoint has no tasks at all)
    ("submitted", SleepEvent.GATHER): "gathered",
    ("running", SleepEvent.GATHER): "gathered",
    # accepted before its environment was built, and then the build failed or the agent cancelled every task:
    # its tasks end without being submitted
    ("snapshotted", SleepEvent.GATHER): "gathered",
    ("gathered", SleepEvent.WAKE): "woken",
    # woken early (`wake_on`, `rest` "run"): the early wake is written before the rest is gathered
    ("submitted", SleepEvent.GATHER_EARLY): "early_gathered",
    ("running", SleepEvent.GATHER_EARLY): "early_gathered",
    ("early_gathered", SleepEvent.WAKE_EARLY): "early_woken",
    ("early_woken", SleepEvent.GATHER): "gathered",
}

SLEEP_TERMINAL: Final = frozenset({"woken", "rejected"})
# A sleep whose wake is recorded (its exact bytes in the store) is over for the agent: its wake files may be
# readable before the kernel records `woken`, and they are (re)written from those bytes whatever happens, so a next
# sleep decided in between must not be told this one "has not woken".
SLEEP_OVER_FOR_AGENT: Final = frozenset({"gathered", *SLEEP_TERMINAL})
# A sleep woken early whose rest still runs: its early wake is recorded (and may be read), its other tasks live. It
# is in flight (its tasks hold their slots, GPUs and reservations, and count toward max_sleeps_in_flight) until
# the rest is gathered.
SLEEP_WOKEN_EARLY: Final = frozenset({"early_gathered", "early_woken"})

_ENDED_ON_ITS_OWN: Final[frozenset[TaskState]] = frozenset(
    {"COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY"}
)
_LOST: Final[frozenset[TaskState]] = frozenset({"NODE_FAIL", "PREEMPTED", "VANISHED"})

TASK_TRANSITIONS: Final[dict[tuple[TaskState, TaskEvent], frozenset[TaskState]]] = {
    ("PENDING", TaskEvent.START): frozenset({"RUNNING"}),
    ("PENDING", TaskEvent.CANCEL): frozenset({"CANCELLED"}),
    ("PENDING", TaskEvent.FINISH): _ENDED_ON_ITS_OWN,
    ("PENDING", TaskEvent.LOSE): _LOST,
    ("PENDING", TaskEvent.SKIP): frozenset({"REUSED", "SKIPPED"}),
    ("RUNNING", TaskEvent.FINISH): _ENDED_ON_ITS_OWN,
    ("RUNNING", TaskEvent.CANCEL): frozenset({"CANCELLED"}),
    ("RUNNING", TaskEvent.LOSE): _LOST,
}

# Derived from the table, never kept by hand: a task is live while the table has a move out of its state, and
# terminal once it reaches a state with none. Every protocol task state is one or the other
# (tests/unit/test_lifecycle.py).
LIVE_TASK_STATES: Final[frozenset[TaskState]] = frozenset(s for (s, _) in TASK_TRANSITIONS)
# Where every task starts: the one live state no move leads into.
(FIRST_TASK_STATE,) = LIVE_TASK_STATES - frozenset().union(*TASK_TRANSITIONS.values())
TERMINAL_TASK_STATES: Final[frozenset[TaskState]] = frozenset(get_args(TaskState)) - LIVE_TASK_STATES
# A submit's evaluation run the kernel decided not to run: REUSED (the base's measurement of an earlier submit
# with the same seeds stands in for it) or SKIPPED (nothing to compare: the candidate's tree is the base's, or
# there is no base). Neither was charged.
NOT_RUN_TASK_STATES: Final[frozenset[TaskState]] = TASK_TRANSITIONS[("PENDING", TaskEvent.SKIP)]

# A task stopped before its command ended on its own (the walltime, its memory limit, a cancel, the node or the
# scheduler): what it left, its artifacts included, is as it was when it was stopped (the wake marks them partial).
STOPPED_TASK_STATES: Final[frozenset[TaskState]] = (
    TERMINAL_TASK_STATES - NOT_RUN_TASK_STATES - frozenset({"COMPLETED", "FAILED"})
)


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow: a kernel bug."""


def sleep_can(state: SleepState, event: SleepEvent) -> bool:
    """Whether the table has a move for `event` out of `state`: the guard a step asks before it does its work
    (the write that follows is still a compare-and-set from `state`)."""
    return (state, event) in SLEEP_TRANSITIONS


def next_sleep_state(state: SleepState, event: SleepEvent) -> SleepState:
    try:
        return SLEEP_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"sleep in state {state!r} cannot {event.value}") from None


def next_task_state(state: TaskState, event: TaskEvent, outcome: TaskState | None = None) -> TaskState:
    """The task's next state. `outcome` picks among the event's allowed states (e.g. FINISH -> FAILED)."""
    allowed = TASK_TRANSITIONS.get((state, event))
    if allowed is None:
        raise IllegalTransition(f"task in state {state!r} cannot {event.value}")
    if outcome is None:
        if len(allowed) != 1:
            raise IllegalTransition(f"task event {event.value} from {state!r} needs one of {sorted(allowed)}")
        return next(iter(allowed))
    if outcome not in allowed:
        raise IllegalTransition(f"task in state {state!r} cannot {event.value} into {outcome!r}")
    return outcome


def sleep_states() -> list[str]:
    """Every sleep state in lifecycle order."""
    order = ["received"]
    for (src, _), dst in SLEEP_TRANSITIONS.items():
        for s in (src, dst):
            if s not in order:
                order.append(s)
    return order


def render_tables() -> str:
    """The lifecycle tables as markdown, for spec/PROTOCOL.md."""
    lines = ["| sleep state | event | next state |", "|---|---|---|"]
    lines += [f"| `{s}` | `{e.value}` | `{d}` |" for (s, e), d in SLEEP_TRANSITIONS.items()]
    lines += ["", "| task state | event | next states |", "|---|---|---|"]
    lines += [
        f"| `{s}` | `{e.value}` | {', '.join(f'`{x}`' for x in sorted(d))} |"
        for (s, e), d in TASK_TRANSITIONS.items()
    ]
    return "\n".join(lines) + "\n"
