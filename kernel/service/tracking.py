"""Tracking: each task's end and start recorded in the store, from the backend's events and the run directories.

Step 2 of a sleep's life (kernel.service.execute): `backend.wait_any_exit` reports each task's end at once
(`on_exit`); a sweep (`sweep`, `sweep_all`) re-reads the exit files of every live task (the ground truth: events only make it faster)
and marks tasks whose `started` file appeared RUNNING. Each end is recorded with the state, exit code and signal
the backend's `outcome_of` reads from it (kernel.core.exits, the one table), and its times; the executor then
offers the sleep to gathering (kernel.service.waking).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from channel.lifecycle import LIVE_TASK_STATES, TERMINAL_TASK_STATES, SleepEvent, TaskEvent
from kernel.backends import jobscript
from kernel.backends.base import RunnableBackend, TaskExit
from kernel.core.exits import Outcome
from kernel.core.records import JobRow
from kernel.io import log as klog
from kernel.io.crash import crash_point
from kernel.io.store import StoreWorker, timestamp
from kernel.service import gather


def _split_key(key: str) -> tuple[str, int, str] | None:
    parts = key.split("/")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


@dataclass(frozen=True, slots=True)
class Seen:
    """What a live task's run directory shows, read outside any store step: its end (`outcome`, with its times),
    else whether it has started (`started`, its start time, when a PENDING task's `started` file is there)."""

    outcome: Outcome | None
    started: float | None = None
    ended: float | None = None
    running: bool = False


class Tracker:
    """Records task ends and starts. The run directories are read first (`seen_in`, on a plain thread: the
    kernel's own files, kernel.service.heavy), then recorded in a store step (`record_*`), which uses sqlite only:
    on Slurm the run directories are a shared filesystem that can hang, and a store step holds the store's lock."""

    def __init__(self, worker: StoreWorker, backend: RunnableBackend) -> None:
        self.worker = worker
        self.store = worker.store
        self.backend = backend

    def seen_in(self, task_dir: Path, *, pending: bool) -> Seen | None:
        """(no store) The task's end from its exit record; else, for a `pending` task, its start; None: neither."""
        out = self.backend.outcome_of(task_dir)
        if out is not None:
            started, ended = gather.task_times(task_dir)
            return Seen(out, started, ended)
        if pending and (task_dir / jobscript.NAMES.STARTED).exists():
            return Seen(
                None, gather.stamp(jobscript.read_timestamp(task_dir, jobscript.NAMES.STARTED)), None, True
            )
        return None

    def record_exit(self, key: str, seq: int, launch: str, task: int, task_dir: Path, seen: Seen) -> bool:
        """(store worker) Record a task's end as its exit record showed it (`seen`); True if this call recorded it."""
        out = seen.outcome
        if out is None:
            return False
        started, ended = seen.started, seen.ended
        now = timestamp()
        with self.store.transaction():
            job = next(
                (j for j in self.store.jobs_of(key, seq) if j.launch == launch and j.task == task), None
            )
            if job is None or job.state in TERMINAL_TASK_STATES:
                return False
            if not self.store.advance_task(
                key,
                seq,
                launch,
                task,
                job.state,
                out.event,
                out.state,
                at=now,
                exit_code=out.exit_code,
                signal=out.signal,
                started_at=timestamp(started) if started is not None else None,
                ended_at=timestamp(ended) if ended is not None else now,
                run_dir=str(task_dir),
            ):
                return False
        klog.event(
            "task_ended",
            ws=key,
            seq=seq,
            launch=launch,
            task=task,
            job=job.job_id,
            state=out.state,
            code=out.exit_code,
        )
        return True

    def live_tasks(self, sleeps: list[tuple[str, int]]) -> list[JobRow]:
        """(store worker) The live tasks of `sleeps` that were handed to the backend (they have a run directory)."""
        return [
            j
            for key, seq in sleeps
            for j in self.store.jobs_of(key, seq)
            if j.state in LIVE_TASK_STATES and j.run_dir is not None
        ]

    def look_at(self, jobs: list[JobRow]) -> list[tuple[JobRow, Seen]]:
        """(a plain thread; no store) What each task's run directory shows."""
        found = []
        for j in jobs:
            assert j.run_dir is not None  # live_tasks
            seen = self.seen_in(Path(j.run_dir), pending=j.state == "PENDING")
            if seen is not None:
                found.append((j, seen))
        return found

    def record_seen(self, found: list[tuple[JobRow, Seen]]) -> list[JobRow]:
        """(store worker) Record the ends and starts `look_at` found; the tasks whose end or start this recorded."""
        changed = []
        for j, seen in found:
            assert j.run_dir is not None  # live_tasks
            if self.record_exit(j.workspace, j.seq, j.launch, j.task, Path(j.run_dir), seen) or (
                j.state == "PENDING" and seen.running and self.mark_running(j, seen.started)
            ):
                changed.append(j)
        return changed

    async def sweep(self, sleeps: list[tuple[str, int]]) -> list[JobRow]:
        """Ground truth for `sleeps`: record ends whose exit file is there; mark started tasks RUNNING. The tasks
        whose end or start this recorded."""
        jobs = await self.worker.call(self.live_tasks, sleeps)
        if not jobs:
            return []
        found = await anyio.to_thread.run_sync(self.look_at, jobs)
        return await self.worker.call(self.record_seen, found) if found else []

    async def sweep_all(self) -> tuple[list[tuple[str, int]], set[tuple[str, int]]]:
        """`sweep` every sleep in flight; those sleeps, and those of them whose tasks this changed."""
        sleeps = await self.worker.call(self.live_sleeps)
        changed = await self.sweep(sleeps)
        return sleeps, {(j.workspace, j.seq) for j in changed}

    def mark_running(self, job: JobRow, started: float | None) -> bool:
        """(store worker) A PENDING task whose `started` file appeared (at `started`) is RUNNING; True if this call
        recorded it."""
        now = timestamp()
        with self.store.transaction():
            fresh = next(
                (
                    j
                    for j in self.store.jobs_of(job.workspace, job.seq)
                    if (j.launch, j.task) == (job.launch, job.task)
                ),
                None,
            )
            if fresh is None or not self.store.advance_task(
                fresh.workspace,
                fresh.seq,
                fresh.launch,
                fresh.task,
                "PENDING",
                TaskEvent.START,
                at=now,
                started_at=timestamp(started) if started is not None else now,
            ):
                return False
            # The first task seen running moves the sleep on; a later one finds it moved already.
            self.store.advance_sleep(job.workspace, job.seq, "submitted", SleepEvent.START)
        return True

    def live_sleeps(self) -> list[tuple[str, int]]:
        """(store worker) The sleeps whose tasks are tracked."""
        return [
            (s.workspace, s.seq)
            for s in self.store.live_sleeps()
            if s.state in ("submitted", "running", "early_gathered", "early_woken", "gathered")
        ]

    async def on_exit(self, ex: TaskExit) -> tuple[str, int, bool] | None:
        """Record the end the backend reported; the sleep to offer to gathering and whether this call recorded the
        end (None: not a launch of ours)."""
        parsed = _split_key(ex.key)
        if parsed is None:
            return None
        key, seq, launch = parsed
        task_dir = Path(ex.task_dir)
        seen = await anyio.to_thread.run_sync(lambda: self.seen_in(task_dir, pending=False))
        recorded = seen is not None and await self.worker.call(
            self.record_exit, key, seq, launch, ex.task, task_dir, seen
        )
        if recorded:
            live = await self.worker.call(self.store.jobs_of, key, seq)
            if any(j.state in LIVE_TASK_STATES for j in live):
                crash_point("task_end")
        return key, seq, recorded
