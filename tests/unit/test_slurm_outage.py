"""The Slurm outage's timing (kernel.backends.slurm.outage, pure): from the last call that succeeded, not the first
that failed (issue 24: a 30 s outage was logged as `lasted_s=18.0`, the first squeue failing 12 s into it)."""

from __future__ import annotations

from kernel.backends.slurm.outage import Outage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_timed_from_the_last_success_before_it() -> None:
    clock = Clock()
    out = Outage(clock, wall=lambda: clock.now + 1_700_000_000)
    assert out.succeeded() is None  # no outage: nothing ended
    clock.now = 1002.0  # the last squeue that answered; the controller stops right after it
    assert out.succeeded() is None
    clock.now = 1014.0  # the next poll fails 12 s into the outage
    began = out.failed("squeue: timed out")
    assert began is not None
    assert began.since_wall == 1002.0 + 1_700_000_000
    assert out.since_wall == began.since_wall
    clock.now = 1020.0
    assert out.failed("squeue: timed out") is None  # the same outage
    clock.now = 1032.0  # back after 30 s
    ended = out.succeeded()
    assert ended is not None
    assert (ended.lasted_s, ended.first_failure_after_s, ended.failed_calls) == (30.0, 12.0, 2)
    assert out.since_wall is None
    # The next outage counts its own calls, from its own last success.
    clock.now = 1040.0
    began = out.failed("sbatch: busy")
    assert began is not None
    assert began.since_wall == 1032.0 + 1_700_000_000
    assert out.failed_calls == 1


def test_an_outage_at_start_is_timed_from_the_first_failure() -> None:
    clock = Clock()
    out = Outage(clock, wall=lambda: clock.now)
    began = out.failed("squeue: unreachable")
    assert began is not None
    assert began.since_wall == 1000.0
    clock.now = 1005.0
    ended = out.succeeded()
    assert ended is not None
    assert (ended.lasted_s, ended.first_failure_after_s) == (5.0, 0.0)
