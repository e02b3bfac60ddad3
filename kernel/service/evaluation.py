"""The evaluation strategy: what the executor asks at each step of a sleep that may carry more than launches.

The executor (kernel.service.execute) dispatches, tracks, gathers and wakes every sleep the same way; what a
submit adds (a plan decided once the snapshot is recorded, evaluation runs with seeds and the base tree, a
verdict at gathering, the operator's hook, the start's base upgrade) is an `Evaluation` it is given. A kernel
whose sleeps carry no submit uses `PlainSleeps`, which adds nothing. kernel.service.submitexec's
`SubmitEvaluation` is the submit's.

The executor calls, in a sleep's order:
1. `precheck` (async, before the snapshot; may raise `SnapshotError`, which refuses the sleep at no cost);
2. `prepare` (store worker thread, once the snapshot is recorded, before any launch is built; idempotent: it runs
   again after a crash);
3. `specs` (with the plain JobSpec of every launch to dispatch; returns them as they are to run);
4. `forget` (after dispatch, also when it raised: drop what `prepare` kept for `specs`);
5. `read_runs` (heavy pool, before the gather transaction: what `judge` needs of the tasks' run directories),
   then `judge` (store worker thread, inside the gather transaction, from the store and those reads only: the
   tasks the wake shows and the verdict);
6. `settle` (async, after every gathering attempt and every tick: follow-up work such as the operator's hook).
`run` is started in the executor's task group (background work for as long as the service runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from channel.messages import TaskResult, Verdict
from kernel.backends.base import JobSpec
from kernel.backends.jobscript import ExitRecord
from kernel.core.records import JobRow, SleepRow
from kernel.service.executor import SleepOrder


@dataclass(frozen=True, slots=True)
class RunFiles:
    """What `judge` reads of one task's run directory (read before the gather's store step, which uses sqlite
    only): its exit record, its stdout and, when its score stage ran, the scorer's stdout."""

    exit: ExitRecord | None
    stdout: str
    score_stdout: str | None = None


# (launch, task) -> its run directory's files; a task without one (never handed over) is absent.
Runs = Mapping[tuple[str, int], RunFiles]


class Evaluation(Protocol):
    async def precheck(self, order: SleepOrder) -> None: ...

    async def prepare(self, order: SleepOrder, commit: str, tree: str) -> None: ...

    def specs(self, order: SleepOrder, specs: dict[str, JobSpec]) -> dict[str, JobSpec]: ...

    def forget(self, order: SleepOrder) -> None: ...

    def read_runs(self, jobs: Sequence[JobRow]) -> Runs: ...

    def judge(
        self, sleep: SleepRow, tasks: tuple[TaskResult, ...], runs: Runs
    ) -> tuple[tuple[TaskResult, ...], Verdict | None]: ...

    async def settle(self) -> None: ...

    async def run(self) -> None: ...


class PlainSleeps:
    """No evaluation: every launch runs as written and the wake shows every task, with no verdict."""

    async def precheck(self, order: SleepOrder) -> None:
        return None

    async def prepare(self, order: SleepOrder, commit: str, tree: str) -> None:
        return None

    def specs(self, order: SleepOrder, specs: dict[str, JobSpec]) -> dict[str, JobSpec]:
        return specs

    def forget(self, order: SleepOrder) -> None:
        return None

    def read_runs(self, jobs: Sequence[JobRow]) -> Runs:
        return {}

    def judge(
        self, sleep: SleepRow, tasks: tuple[TaskResult, ...], runs: Runs
    ) -> tuple[tuple[TaskResult, ...], Verdict | None]:
        return tasks, None

    async def settle(self) -> None:
        return None

    async def run(self) -> None:
        return None
