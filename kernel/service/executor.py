"""The one place where execution plugs into the request pipeline.

The pipeline validates a sleep, charges the budget and records the sleep and its tasks (PENDING jobs) in the
store, commits, and only then calls `Executor.dispatch`, which snapshots and submits and returns the job refs
for the `accepted` answer. A `cancel` is recorded the same way before `Executor.cancel` is called. At start,
`recover()` runs before the pipeline resumes interrupted requests, and `run()` is started in the service's task
group for whatever the executor tracks (jobs ending, wakes). Every method may be called again for the same sleep
after a crash, so implementations look before they act (a backend job named after the sleep is not resubmitted).

`PendingExecutor` is the executor of a kernel without execution: it leaves the tasks PENDING and answers
`accepted` with no backend job ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from channel.decode import RequestError
from channel.messages import EnvironmentBuild, JobRef, SleepRequest
from kernel.core.records import JobRow, SleepRow, WorkspaceRow
from kernel.io.store import StoreWorker


class ExecutorUnavailable(Exception):
    """The world's fault (scheduler down, disk full): the request stays unanswered and is retried later.
    Any other exception from an executor is a kernel bug and stops the service."""


class DispatchRefused(Exception):
    """The sleep cannot run for a reason that is the agent's (e.g. `snapshot.failed`): the pipeline rejects it,
    refunds the charge and answers `rejected` with this error."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True, slots=True)
class SleepOrder:
    """A recorded, charged sleep as the executor receives it (re-read from the store, also after a crash)."""

    workspace: WorkspaceRow
    sleep: SleepRow
    request: SleepRequest
    jobs: tuple[JobRow, ...]


class Executor(Protocol):
    async def recover(self) -> None:
        """Reconcile recorded jobs with the backend after a (re)start, before any request is handled."""
        ...

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        """Snapshot and submit the order's tasks (recording each step); return one ref per task.

        Raise `DispatchRefused` for a refusal that is the agent's fault, `ExecutorUnavailable` for the world's
        (the request stays unanswered and is retried at the next rescan).
        """
        ...

    async def cancel(self, order: SleepOrder, launches: tuple[str, ...]) -> None:
        """Cancel the named launches' submitted tasks (all of them if empty); unsubmitted tasks are already
        recorded CANCELLED and refunded by the pipeline."""
        ...

    async def run(self) -> None:
        """Track work until cancelled (the service cancels it at shutdown). May return at once."""
        ...

    def degraded(self) -> str | None:
        """Why part of the executor's work is stalled now (the others' goes on), for the status line; or None."""
        ...

    # Called in store steps (memory only, never a file): a sleep accepted before its environment was built.
    def accepted_building(self, key: str, seq: int) -> EnvironmentBuild | None:
        """The build the `accepted` answer of a sleep just dispatched names (once), or None."""
        ...

    def environment_of(self, key: str, seq: int) -> EnvironmentBuild | None:
        """The build the sleep's tasks wait for, with its log's last lines, for `status`; or None."""
        ...

    def environment_log(self, key: str, seq: int, lines: int) -> tuple[str, int, bool] | None:
        """The last `lines` lines of that build's log (text, bytes, cut), for `tail`; or None."""
        ...


class PendingExecutor:
    """Execution is not built yet: tasks stay PENDING and `accepted` carries no backend job ids."""

    def __init__(self, worker: StoreWorker) -> None:
        self._worker = worker

    async def recover(self) -> None:
        return None

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        return tuple(JobRef(launch=j.launch, task=j.task, job_id=j.job_id) for j in order.jobs)

    async def cancel(self, order: SleepOrder, launches: tuple[str, ...]) -> None:
        return None

    async def run(self) -> None:
        return None

    def degraded(self) -> str | None:
        return None

    def accepted_building(self, key: str, seq: int) -> EnvironmentBuild | None:
        return None

    def environment_of(self, key: str, seq: int) -> EnvironmentBuild | None:
        return None

    def environment_log(self, key: str, seq: int, lines: int) -> tuple[str, int, bool] | None:
        return None
