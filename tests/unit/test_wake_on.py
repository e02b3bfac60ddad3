"""Which task's end meets a sleep's `wake_on` (kernel.core.wakeon, pure), and what the early and rest wakes say
(channel.render)."""

from __future__ import annotations

import pytest

from channel.messages import Budget, JobRef, TaskResult, Wake
from channel.render import render_wake
from kernel.core import wakeon
from kernel.core.records import JobRow

NOW = "2026-12-03T12:00:00.000Z"


def job(task: int, state: str, ended: str | None = None, launch: str = "a") -> JobRow:
    return JobRow("w", 1, launch, task, 4, 0, "x", 5, 0, (), "", 0, state, ended_at=ended)  # type: ignore[arg-type]


def at(second: int) -> str:
    return f"2026-12-03T12:00:{second:02d}.000Z"


def test_all_never_wakes_early() -> None:
    jobs = [job(0, "FAILED", at(1)), job(1, "RUNNING")]
    assert wakeon.trigger("all", jobs) is None
    assert wakeon.early_trigger("all", jobs) is None


def test_first_failure_is_the_first_end_that_is_not_a_success_or_a_cancel() -> None:
    jobs = [
        job(0, "COMPLETED", at(1)),
        job(1, "CANCELLED", at(2)),
        job(2, "TIMEOUT", at(5)),
        job(3, "OUT_OF_MEMORY", at(4)),
        job(4, "RUNNING"),
    ]
    got = wakeon.early_trigger("first-failure", jobs)
    assert got is not None
    assert (got.task, got.state) == (3, "OUT_OF_MEMORY")  # ended before task 2's timeout
    assert wakeon.trigger("first-failure", jobs[:2]) is None  # a success and a cancel are not failures
    for state in ("FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "VANISHED"):
        assert state in wakeon.FAILURE_STATES
    assert not {"COMPLETED", "CANCELLED", "REUSED", "SKIPPED"} & wakeon.FAILURE_STATES


def test_first_exit_is_the_first_end_however_it_ended() -> None:
    jobs = [job(0, "RUNNING"), job(1, "CANCELLED", at(3)), job(2, "COMPLETED", at(2))]
    got = wakeon.early_trigger("first-exit", jobs)
    assert got is not None
    assert got.task == 2
    assert wakeon.early_trigger("first-exit", [job(0, "PENDING"), job(1, "RUNNING")]) is None


def test_a_count_is_met_by_the_nth_end_and_ties_keep_task_order() -> None:
    jobs = [
        job(0, "COMPLETED", at(2)),
        job(1, "FAILED", at(2)),
        job(2, "COMPLETED", at(1)),
        job(3, "RUNNING"),
    ]
    assert [j.task for j in wakeon.ended_in_order(jobs)] == [2, 0, 1]
    for n, task in ((1, 2), (2, 0), (3, 1)):
        got = wakeon.early_trigger(n, jobs)
        assert got is not None
        assert got.task == task
    assert wakeon.trigger(4, jobs) is None


def test_a_condition_met_by_the_last_end_is_no_early_wake() -> None:
    """Every task ended: the sleep wakes once, as any other (tasks that all fail at once)."""
    jobs = [job(i, "FAILED", at(1)) for i in range(4)]
    assert wakeon.trigger("first-failure", jobs) is not None
    assert wakeon.early_trigger("first-failure", jobs) is None
    assert wakeon.live(jobs) == []


@pytest.mark.parametrize(
    ("wake_on", "text"), [("first-failure", "first-failure"), (1, "1 task ended"), (3, "3 tasks ended")]
)
def test_condition_text(wake_on: str | int, text: str) -> None:
    assert wakeon.condition_text(wake_on) == text  # type: ignore[arg-type]


def _wake(part: str, tasks: tuple[TaskResult, ...], rest: tuple[JobRef, ...]) -> Wake:
    return Wake(
        protocol=1,
        id="s1",
        seq=3,
        created_at=NOW,
        woken_at=NOW,
        budget=Budget(launches=1, sleeps=1, gpu_hours=1.0),
        tasks=tasks,
        wake_on="first-failure",
        part=part,  # type: ignore[arg-type]
        trigger=JobRef(launch="a", task=0),
        rest_tasks=rest,
    )


def test_an_early_wake_says_what_still_runs_and_how_to_get_the_rest() -> None:
    failed = TaskResult(launch="a", task=0, state="FAILED", exit_code=1, stderr_tail="boom\n")
    tasks = (
        failed,
        TaskResult(launch="a", task=1, state="RUNNING"),
        TaskResult(launch="a", task=2, state="PENDING"),
    )
    md = render_wake(_wake("early", tasks, (JobRef(launch="a", task=1), JobRef(launch="a", task=2))))
    assert md.startswith(
        "# Early wake: sleep s1 (#3): 0 of the 1 task that ended completed, 1 FAILED; 2 of 3 tasks still running\n"
    )
    assert "Woke on `wake_on` first-failure: a[0] FAILED." in md
    assert "Not ended yet, left running (`rest` run): a[1] (RUNNING), a[2] (PENDING)." in md
    assert ".syscall/wakes/s1.rest.md: `syscall wait s1`" in md
    assert "### a[0]: FAILED" in md
    assert "### a[1]" not in md  # still running: no section, no "cancelled" or other hint that is not true
    assert "boom" in md


def test_the_rest_s_wake_details_the_rest_only() -> None:
    failed = TaskResult(launch="a", task=0, state="FAILED", exit_code=1, stderr_tail="boom\n")
    late = TaskResult(launch="a", task=1, state="FAILED", exit_code=2, stderr_tail="late\n")
    md = render_wake(_wake("rest", (failed, late), (JobRef(launch="a", task=1),)))
    assert md.startswith("# Rest of sleep s1 (#3): every task has ended: 0 of 2 tasks completed, 2 FAILED\n")
    assert "this wake delivers the 1 task it left running (a[1])" in md
    assert "### a[1]: FAILED" in md
    assert "### a[0]" not in md  # the early wake detailed it
    assert "late" in md
    assert "boom" not in md


def test_a_sleep_of_one_task_never_wakes_early() -> None:
    """An array of 1 (or any one task): its end is the sleep's last, whatever the condition."""
    for wake_on in ("first-failure", "first-exit", 1):
        assert wakeon.early_trigger(wake_on, [job(0, "RUNNING")]) is None  # type: ignore[arg-type]
        assert wakeon.early_trigger(wake_on, [job(0, "FAILED", at(1))]) is None  # type: ignore[arg-type]
