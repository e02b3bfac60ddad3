"""The scheduler's outages, timed from their real start (pure logic; the backend feeds it every client call).

An outage begins when a call fails for the world's reasons (a timeout, an unreachable or busy controller) and
ends at the next call that succeeds. The controller went away somewhere after the last call that succeeded and
before the first that failed; the first failure comes up to a poll interval later (more while the polls back
off, far more when nothing needed Slurm), so the outage is timed from the last success: `lasted_s` is then never
shorter than the outage was. `first_failure_after_s` says how much of it came before the first failed call.
Before any call succeeded (a kernel started during an outage) it is timed from the first failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Began:
    since_wall: float  # the Unix time it is timed from
    error: str  # the first failed call's error


@dataclass(frozen=True, slots=True)
class Ended:
    since_wall: float
    lasted_s: float  # from the last success before it to the success that ended it
    first_failure_after_s: float  # from the last success to the first failed call
    failed_calls: int


class Outage:
    def __init__(self, clock: Callable[[], float], wall: Callable[[], float] = time.time) -> None:
        """`clock` measures durations (monotonic), `wall` says when (Unix time)."""
        self._clock = clock
        self._wall = wall
        self._last_ok: tuple[float, float] | None = None  # (clock, wall) of the latest call that succeeded
        self._since: tuple[float, float] | None = None  # (clock, wall) the outage in progress is timed from
        self._first_failed = 0.0
        self.failed_calls = 0
        self.last_error = ""

    @property
    def since_wall(self) -> float | None:
        """When the outage in progress began (Unix time), None while there is none."""
        return None if self._since is None else self._since[1]

    def succeeded(self) -> Ended | None:
        """A call succeeded: the outage in progress, if any, is over."""
        now = (self._clock(), self._wall())
        since, self._since, self._last_ok = self._since, None, now
        if since is None:
            return None
        return Ended(
            since_wall=since[1],
            lasted_s=round(now[0] - since[0], 1),
            first_failure_after_s=round(self._first_failed - since[0], 1),
            failed_calls=self.failed_calls,
        )

    def failed(self, error: str) -> Began | None:
        """A call failed for the world's reasons; the outage that begins with it, if it is the first."""
        self.last_error = error
        self.failed_calls += 1
        if self._since is not None:
            return None
        now = (self._clock(), self._wall())
        self._since = self._last_ok or now
        self._first_failed = now[0]
        self.failed_calls = 1
        return Began(since_wall=self._since[1], error=error)
