"""Tracking: each task's end and start recorded in the store, from the backend's events and the run directories.

Step 2 of a sleep's life (kernel.service.execute): `backend.wait_any_exit` reports each task's end at once
(`on_exit`); a sweep re-reads the exit files of every live task (the ground truth: events only make it faster)
and marks tasks whose `started` file appeared RUNNING. Each end is recorded with the state, exit code and signal
the backend's `outcome_of` reads from it (kernel.core.exits, the one table), and its times; the executor then
offers the sleep to gathering (kernel.service.waking).
"""

from __future__ import annotations

from pathlib import Path

from channel.lifecycle import LIVE_TASK_STATES, TERMINAL_TASK_STATES, SleepEvent, TaskEvent
from kernel.backends import jobscript
from kernel.backends.base import RunnableBackend, TaskExit
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


class Tracker:
    """Records task ends and starts (store worker for the `record_*`/`sweep_*` methods)."""

    def __init__(self, worker: StoreWorker, backend: RunnableBackend) -> None:
        self.worker = worker
        self.store = worker.store
        self.backend = backend

    def record_exit(self, key: str, seq: int, launch: str, task: int, task_dir: Path) -> bool:
        """Record a task's end from its exit record; True if this call recorded it."""
        out = self.backend.outcome_of(task_dir)
        if out is None:
            return False
        started, ended = gather.task_times(task_dir)
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

    def sweep_sleep(self, key: str, seq: int) -> list[JobRow]:
        """Ground truth for one sleep: record ends whose exit file is there; mark started tasks RUNNING."""
        changed = []
        for j in self.store.jobs_of(key, seq):
            if j.state not in LIVE_TASK_STATES or j.run_dir is None:
                continue
            tdir = Path(j.run_dir)
            if self.record_exit(key, seq, j.launch, j.task, tdir):
                changed.append(j)
            elif j.state == "PENDING" and (tdir / jobscript.NAMES.STARTED).exists():
                self.mark_running(j, tdir)
        return changed

    def mark_running(self, job: JobRow, tdir: Path) -> None:
        started = gather.stamp(jobscript.read_timestamp(tdir, jobscript.NAMES.STARTED))
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
                return
            # The first task seen running moves the sleep on; a later one finds it moved already.
            self.store.advance_sleep(job.workspace, job.seq, "submitted", SleepEvent.START)

    def live_sleeps(self) -> list[tuple[str, int]]:
        return [
            (s.workspace, s.seq)
            for s in self.store.live_sleeps()
            if s.state in ("submitted", "running", "gathered")
        ]

    def sweep_all(self) -> list[tuple[str, int]]:
        out = []
        for key, seq in self.live_sleeps():
            self.sweep_sleep(key, seq)
            out.append((key, seq))
        return out

    async def on_exit(self, ex: TaskExit) -> tuple[str, int] | None:
        """Record the end the backend reported; the sleep to offer to gathering (None: not a launch of ours)."""
        parsed = _split_key(ex.key)
        if parsed is None:
            return None
        key, seq, launch = parsed
        recorded = await self.worker.call(self.record_exit, key, seq, launch, ex.task, Path(ex.task_dir))
        if recorded:
            live = await self.worker.call(self.store.jobs_of, key, seq)
            if any(j.state in LIVE_TASK_STATES for j in live):
                crash_point("task_end")
        return key, seq
