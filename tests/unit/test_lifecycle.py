"""The lifecycle tables: every legal transition works, every other one raises, and the graph has the promised shape."""

from __future__ import annotations

import itertools

import pytest

from channel.lifecycle import (
    SLEEP_TERMINAL,
    SLEEP_TRANSITIONS,
    TASK_TRANSITIONS,
    TERMINAL_TASK_STATES,
    IllegalTransition,
    SleepEvent,
    TaskEvent,
    next_sleep_state,
    next_task_state,
    render_tables,
    sleep_can,
    sleep_states,
)

SLEEP_STATES = sleep_states()
TASK_STATES = ["PENDING", "RUNNING", *sorted(TERMINAL_TASK_STATES)]


def test_sleep_states_in_lifecycle_order() -> None:
    assert SLEEP_STATES == [
        "received",
        "validated",
        "rejected",
        "snapshotted",
        "submitted",
        "running",
        "gathered",
        "woken",
        "early_gathered",
        "early_woken",
    ]
    happy = ["received", "validated", "snapshotted", "submitted", "running", "gathered", "woken"]
    events = [
        SleepEvent.VALIDATE,
        SleepEvent.SNAPSHOT,
        SleepEvent.SUBMIT,
        SleepEvent.START,
        SleepEvent.GATHER,
    ]
    events.append(SleepEvent.WAKE)
    state = "received"
    for event, expected in zip(events, happy[1:], strict=True):
        state = next_sleep_state(state, event)
        assert state == expected


@pytest.mark.parametrize(("key", "target"), list(SLEEP_TRANSITIONS.items()), ids=str)
def test_every_legal_sleep_transition(key: tuple[str, SleepEvent], target: str) -> None:
    assert next_sleep_state(*key) == target


@pytest.mark.parametrize(
    ("state", "event"),
    [k for k in itertools.product(SLEEP_STATES, SleepEvent) if k not in SLEEP_TRANSITIONS],
    ids=str,
)
def test_every_illegal_sleep_transition_raises(state: str, event: SleepEvent) -> None:
    with pytest.raises(IllegalTransition, match=state):
        next_sleep_state(state, event)


def test_a_guard_asks_the_table() -> None:
    """`sleep_can` is true exactly where `next_sleep_state` has a move (the guards in dispatch and waking use it
    instead of naming states)."""
    for state, event in itertools.product(SLEEP_STATES, SleepEvent):
        legal = (state, event) in SLEEP_TRANSITIONS
        assert sleep_can(state, event) == legal
        if not legal:
            with pytest.raises(IllegalTransition):
                next_sleep_state(state, event)
    # snapshotted: a sleep answered while its environment is built, whose build failed or whose tasks were all
    # cancelled meanwhile
    # early_woken: a sleep woken early (`wake_on`) whose rest has ended
    assert [s for s in SLEEP_STATES if sleep_can(s, SleepEvent.GATHER)] == [
        "snapshotted",
        "submitted",
        "running",
        "early_woken",
    ]


def test_an_early_wake_is_written_before_its_rest_is_gathered() -> None:
    """A sleep woken early (`wake_on`, `rest` run): early_gathered (its early wake recorded) may only move on once
    that wake is written (early_woken), and only then is its rest gathered, so neither wake is skipped."""
    state = "running"
    for event in (SleepEvent.GATHER_EARLY, SleepEvent.WAKE_EARLY, SleepEvent.GATHER, SleepEvent.WAKE):
        state = next_sleep_state(state, event)
    assert state == "woken"
    assert next_sleep_state("submitted", SleepEvent.GATHER_EARLY) == "early_gathered"
    assert [e for e in SleepEvent if sleep_can("early_gathered", e)] == [SleepEvent.WAKE_EARLY]
    assert [e for e in SleepEvent if sleep_can("early_woken", e)] == [SleepEvent.GATHER]
    assert not sleep_can("early_woken", SleepEvent.GATHER_EARLY)  # one early wake per sleep


def test_rejection_only_before_any_job_is_submitted() -> None:
    sources = {s for (s, e) in SLEEP_TRANSITIONS if e is SleepEvent.REJECT}
    assert sources == {"received", "validated", "snapshotted"}


def test_terminal_sleep_states_have_no_way_out() -> None:
    assert {"woken", "rejected"} == SLEEP_TERMINAL
    assert not [k for k in SLEEP_TRANSITIONS if k[0] in SLEEP_TERMINAL]


def test_every_sleep_state_is_reachable_and_can_end() -> None:
    reach = {"received"}
    while True:
        more = {d for (s, _), d in SLEEP_TRANSITIONS.items() if s in reach} - reach
        if not more:
            break
        reach |= more
    assert reach == set(SLEEP_STATES)
    for state in SLEEP_STATES:
        seen, frontier = {state}, {state}
        while frontier:
            frontier = {d for (s, _), d in SLEEP_TRANSITIONS.items() if s in frontier} - seen
            seen |= frontier
        assert seen & SLEEP_TERMINAL, f"{state} can never end"


def test_a_checkpoint_gathers_straight_from_submitted() -> None:
    assert next_sleep_state("submitted", SleepEvent.GATHER) == "gathered"


@pytest.mark.parametrize(
    ("state", "event", "outcome"),
    [(s, e, o) for (s, e), outs in TASK_TRANSITIONS.items() for o in sorted(outs)],
    ids=str,
)
def test_every_legal_task_transition(state: str, event: TaskEvent, outcome: str) -> None:
    assert next_task_state(state, event, outcome) == outcome
    if len(TASK_TRANSITIONS[(state, event)]) == 1:
        assert next_task_state(state, event) == outcome


@pytest.mark.parametrize(
    ("state", "event"),
    [k for k in itertools.product(TASK_STATES, TaskEvent) if k not in TASK_TRANSITIONS],
    ids=str,
)
def test_every_illegal_task_transition_raises(state: str, event: TaskEvent) -> None:
    with pytest.raises(IllegalTransition):
        next_task_state(state, event)
    for outcome in TASK_STATES:
        with pytest.raises(IllegalTransition):
            next_task_state(state, event, outcome)


@pytest.mark.parametrize(("state", "event"), list(TASK_TRANSITIONS), ids=str)
def test_a_task_outcome_outside_the_event_raises(state: str, event: TaskEvent) -> None:
    allowed = TASK_TRANSITIONS[(state, event)]
    for outcome in set(TASK_STATES) - allowed:
        with pytest.raises(IllegalTransition, match=outcome):
            next_task_state(state, event, outcome)
    if len(allowed) > 1:
        with pytest.raises(IllegalTransition, match="needs one of"):
            next_task_state(state, event)


def test_terminal_task_states_never_change() -> None:
    for state, event in itertools.product(sorted(TERMINAL_TASK_STATES), TaskEvent):
        with pytest.raises(IllegalTransition):
            next_task_state(state, event)


def test_render_tables_lists_every_transition() -> None:
    text = render_tables()
    for (s, e), d in SLEEP_TRANSITIONS.items():
        assert f"| `{s}` | `{e.value}` | `{d}` |" in text
    for (s, e), outs in TASK_TRANSITIONS.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{s}` | `{e.value}` |"))
        assert all(f"`{o}`" in row for o in outs)
