"""When a sleep wakes: which task's end meets its `wake_on` (pure; spec 4.4.1, 8.8).

A sleep wakes when every task has ended (`all`, every sleep before `wake_on`), or early: at the first task that
ends without success (`first-failure`), at the first task that ends however (`first-exit`), or once N tasks have
ended (an integer). Tasks are taken in the order they ended (the recorded `ended_at`, then the sleep's task order
for ends recorded at the same instant), so the task that met the condition is the same at every look, after a
restart too.

A wake is early only while some task is still live; a condition met by the sleep's last end is an ordinary wake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from channel.lifecycle import LIVE_TASK_STATES, NOT_RUN_TASK_STATES, TERMINAL_TASK_STATES
from channel.messages import TaskState, WakeOn
from kernel.core.records import JobRow

# The ends `first-failure` wakes on: every end but success, a cancel (the agent's or the kernel's own choice, not
# the task's failure) and a submit's runs that did not run.
FAILURE_STATES: Final[frozenset[TaskState]] = (
    TERMINAL_TASK_STATES - NOT_RUN_TASK_STATES - frozenset({"COMPLETED", "CANCELLED"})
)


def ended_in_order(jobs: Sequence[JobRow]) -> list[JobRow]:
    """The tasks that have ended, in the order they ended (ties in the sleep's task order)."""
    ended = [(j.ended_at or "", i, j) for i, j in enumerate(jobs) if j.state in TERMINAL_TASK_STATES]
    return [j for _, _, j in sorted(ended, key=lambda e: (e[0], e[1]))]


def trigger(wake_on: WakeOn, jobs: Sequence[JobRow]) -> JobRow | None:
    """The task whose end met `wake_on`, or None while it is not met (always None for `all`)."""
    if wake_on == "all":
        return None
    ended = ended_in_order(jobs)
    if wake_on == "first-failure":
        return next((j for j in ended if j.state in FAILURE_STATES), None)
    if wake_on == "first-exit":
        return ended[0] if ended else None
    return ended[wake_on - 1] if len(ended) >= wake_on else None


def early_trigger(wake_on: WakeOn, jobs: Sequence[JobRow]) -> JobRow | None:
    """The task whose end met `wake_on` while others still run (an early wake is due); None when the condition
    is not met, or every task has ended (the sleep then wakes as any other)."""
    if not any(j.state in LIVE_TASK_STATES for j in jobs):
        return None
    return trigger(wake_on, jobs)


def live(jobs: Sequence[JobRow]) -> list[JobRow]:
    """The tasks an early wake leaves behind: every task not ended yet, in the sleep's order."""
    return [j for j in jobs if j.state in LIVE_TASK_STATES]


def condition_text(wake_on: WakeOn) -> str:
    """`wake_on` as a reader says it: 'first-failure', 'first-exit', '3 tasks ended'."""
    if isinstance(wake_on, int):
        return f"{wake_on} task{'' if wake_on == 1 else 's'} ended"
    return wake_on
