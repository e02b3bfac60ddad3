"""Gathering and waking: a sleep whose last task has ended gets its artifacts, its refunds and its wake.

Step 3 of a sleep's life (kernel.service.execute): artifacts are delivered into `results/` (idempotent, heavy
pool), then ONE transaction releases the reservations (refunding what the measured elapsed time did not use),
asks the `Evaluation` strategy to judge the tasks (a submit's verdict), stores the wake's exact bytes and moves
the sleep to `gathered`. Only then are `wakes/<id>.json`, `wakes/<id>.md` and `budget.json` written (from the
stored bytes, so a restart rewrites the same wake), the sleep moves to `woken`, and the snapshot ref is released
(its objects go at the kernel repository's next gc). A channel that cannot be used now defers the step (logged
once per problem); it is retried at every tick.

A workspace the operator unenrolled (`unenroll --force`, its sleep in flight: the executor cancels its jobs) has
no channel any more: its sleep is gathered from the run directories alone (artifacts not delivered, said so in
the stored wake) and ends `woken` with its wake kept in the store only (`event=wake_not_written`), so nothing waits
for a channel that is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Final

import msgspec

from channel import safefs, sweep
from channel.decode import RequestError, parse_request
from channel.lifecycle import TERMINAL_TASK_STATES, SleepEvent, TaskEvent, sleep_can
from channel.messages import ErrorInfo, SkippedArtifact, SleepRequest, TaskResult, Wake, encode
from channel.paths import ChannelPaths
from channel.render import render_wake
from kernel.backends.base import DEFAULT_ARTIFACT_MAX_BYTES, RunnableBackend
from kernel.core import ledger
from kernel.core.config import Config, LiveConfig, default_task_mem_mb
from kernel.core.records import JobRow, WorkspaceRow
from kernel.io import log as klog
from kernel.io.crash import crash_point
from kernel.io.enroll import write_budget
from kernel.io.repo import KernelRepo, RepoError, snapshot_ref
from kernel.io.snapshot import release_sync
from kernel.io.store import StoreWorker, timestamp
from kernel.service import gather, telling
from kernel.service.evaluation import Evaluation, Runs
from kernel.service.gather import job_order
from kernel.service.heavy import HeavyPool

_wake_decoder: Final = msgspec.json.Decoder(Wake)

# What `collect` found for one task: (job, task dir, elapsed seconds, artifacts delivered and skipped).
Collected = tuple[JobRow, Path | None, float | None, gather.TaskFiles]


class Waker:
    """Gathers a complete sleep and writes its wake (each step idempotent, each safe to repeat after a crash)."""

    def __init__(
        self,
        live: LiveConfig,
        worker: StoreWorker,
        backend: RunnableBackend,
        heavy: HeavyPool,
        evaluation: Evaluation,
    ) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.backend = backend
        self.heavy = heavy
        self.evaluation = evaluation
        self._gathering: set[tuple[str, int]] = set()
        self._problems: dict[tuple[str, int], str] = {}

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    def withdrawn(self) -> list[tuple[str, int]]:
        """(store worker) The sleeps in flight, handed to the backend, of workspaces the operator unenrolled."""
        admins = self.store.admins()
        return [
            (s.workspace, s.seq)
            for s in self.store.live_sleeps()
            if s.state in ("submitted", "running")
            and (a := admins.get(s.workspace)) is not None
            and a.unenrolled_at is not None
        ]

    def _unenrolled(self, key: str) -> bool:
        """(store worker) Whether the operator unenrolled the workspace: its channel is gone."""
        return self.store.admin(key).unenrolled_at is not None

    def _gather_inputs(self, key: str, seq: int) -> tuple[WorkspaceRow, list[JobRow], bool] | bool:
        """(store worker) What gathering needs, once every task has ended (and whether the workspace is
        unenrolled); True if already gathered, False if not ready."""
        sleep = self.store.sleep(key, seq)
        if sleep is None or not sleep_can(sleep.state, SleepEvent.GATHER):
            return sleep is not None and sleep.state == "gathered"
        jobs = self.store.jobs_of(key, seq)
        if any(j.state not in TERMINAL_TASK_STATES for j in jobs):
            return False
        ws = self.store.workspace(key)
        assert ws is not None
        return ws, jobs, self._unenrolled(key)

    def _ended(self, j: JobRow) -> tuple[Path | None, float | None]:
        """A task's run directory (None: cancelled before it was ever handed over) and its elapsed seconds."""
        tdir = Path(j.run_dir) if j.run_dir else None
        if tdir is None or self.backend.outcome_of(tdir) is None:
            return None, None
        started, ended = gather.task_times(tdir)
        if started is None or ended is None:
            return tdir, None
        return tdir, round(max(0.0, ended - started), 3)

    def _collect(
        self, ws: WorkspaceRow, seq: int, jobs: list[JobRow], unenrolled: bool = False
    ) -> list[Collected] | None:
        """(heavy pool; no store access) Deliver every task's artifacts into the channel; None if the channel
        cannot be used now (retried at every tick). An unenrolled workspace's channel is gone: nothing is
        delivered, each artifact is skipped saying why."""
        key = ws.key
        results: list[Collected] = []
        if unenrolled:
            why = "not delivered: the operator unenrolled the workspace"
            for j in jobs:
                skipped = gather.TaskFiles(skipped=tuple(SkippedArtifact(a, why) for a in j.artifacts))
                tdir, elapsed = self._ended(j)
                results.append((j, tdir, elapsed, self._with_hint(skipped, tdir)))
            return results
        try:
            with safefs.open_channel(ws.path, ws.identity) as ch:
                for j in jobs:
                    tdir, elapsed = self._ended(j)
                    if tdir is not None:
                        files = gather.deliver_task(
                            ch, j, tdir, DEFAULT_ARTIFACT_MAX_BYTES, self.cfg.log_max_bytes
                        )
                    else:
                        files = gather.TaskFiles(
                            skipped=tuple(
                                SkippedArtifact(a, "not collected: the task never ran") for a in j.artifacts
                            )
                        )
                    results.append((j, tdir, elapsed, self._with_hint(files, tdir)))
        except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
            # Retried at every tick until the channel is usable again; logged once per problem.
            self._problem("gather_deferred", key, seq, f"{type(e).__name__}: {e}")
            return None
        return results

    def _with_hint(self, files: gather.TaskFiles, tdir: Path | None) -> gather.TaskFiles:
        """(heavy pool) `files` with the hint of the task's end, read from its run directory here: the store step
        that records the wake (`_record_gather`) uses sqlite only."""
        if tdir is None:
            return files
        return dataclasses.replace(
            files, hint=gather.end_hint(tdir, self.backend.hint_of, self.backend.outcome_of)
        )

    def _record_gather(self, key: str, seq: int, results: list[Collected], runs: Runs) -> bool:
        """(store worker) Record the wake and the refunds (the sleep -> gathered)."""
        woken_at = timestamp()
        with self.store.transaction():
            sleep = self.store.sleep(key, seq)
            ws = self.store.workspace(key)
            assert sleep is not None
            assert ws is not None
            if not sleep_can(sleep.state, SleepEvent.GATHER):
                return sleep.state == "gathered"
            balance = ws.balance
            refunded = 0
            tasks = []
            fresh = {(j.launch, j.task): j for j in self.store.jobs_of(key, seq)}
            for j, tdir, elapsed, files in results:
                cur = fresh[(j.launch, j.task)]
                settled = ledger.settle_task(balance, cur, elapsed)
                balance = settled.balance
                refunded += settled.refunded_gpu_s
                # updated_at stays the kernel's record of the last state change (rules.cancelled_by)
                self.store.release_job(key, seq, cur.launch, cur.task)
                memory = (default_task_mem_mb(self.cfg, cur.gpus), ws.policy.max_mem_mb)
                tasks.append(gather.task_result(cur, tdir, elapsed, files, self.cfg.environment.mode, memory))
                # what `history --metric` reads of the task later (the wake's bytes are not kept)
                self.store.set_job_metrics(key, seq, cur.launch, cur.task, sweep.numbers_of(tasks[-1].result))
            shown, verdict = self.evaluation.judge(sleep, tuple(tasks), runs)
            exec_row = self.store.exec_sleep(key, seq)
            wake = gather.build_wake(
                sleep_id=sleep.id,
                seq=seq,
                created_at=sleep.created_at,
                woken_at=woken_at,
                note=sleep.note,
                balance=balance,
                tasks=shown,
                refunded_gpu_s=refunded,
                verdict=verdict,
                snapshot=exec_row.commit if exec_row is not None else None,
                launches=gather.launch_summaries(list(fresh.values()), shown, ws.policy.max_concurrent_gpus),
            )
            if verdict is not None:
                self.store.set_sleep_verdict(key, seq, encode(verdict))
            self.store.set_balance(key, balance)
            wake = telling.told(self.store, self.cfg, ws, wake)  # what of the contract changed, told once
            self.store.record_wake(key, seq, snapshot_ref(seq), encode(wake), render_wake(wake).encode())
            # woken_at is the wake's from here on: status and history show a gathered sleep as woken then
            advanced = self.store.advance_sleep(key, seq, sleep.state, SleepEvent.GATHER, woken_at=woken_at)
            assert advanced, (key, seq, sleep.state)  # read in this transaction
        klog.event("gathered", ws=key, seq=seq, id=sleep.id, tasks=len(tasks))
        return True

    def _record_unrun(self, key: str, seq: int, error: RequestError) -> bool:
        """(store worker) An accepted sleep none of whose tasks will run (its environment build failed): every task
        CANCELLED, the whole charge refunded (as for a refused sleep: `ledger.refund_rejected_sleep`), the wake
        with `error` recorded, the sleep -> gathered. False when it is not waiting to be submitted (any more)."""
        now = timestamp()
        with self.store.transaction():
            sleep = self.store.sleep(key, seq)
            ws = self.store.workspace(key)
            if sleep is None or ws is None or not sleep_can(sleep.state, SleepEvent.SUBMIT):
                return sleep is not None and sleep.state == "gathered"
            row = self.store.request(key, sleep.id)
            assert row is not None, (key, seq)
            assert row.body is not None, (key, seq)
            req = parse_request(row.body, sleep.id)
            assert isinstance(req, SleepRequest)
            jobs = self.store.jobs_of(key, seq)
            balance = ledger.refund_rejected_sleep(ws.balance, len(req.launches), jobs)
            for j in jobs:
                if j.state == "PENDING":
                    moved = self.store.advance_task(
                        key,
                        seq,
                        j.launch,
                        j.task,
                        "PENDING",
                        TaskEvent.CANCEL,
                        at=now,
                        ended_at=now,
                        release=True,
                    )
                    assert moved, (key, seq, j.launch, j.task)  # read in this transaction
            fresh = self.store.jobs_of(key, seq)
            hint = f"never started: {error.code} (the wake's error says why); nothing of it was charged"
            never = "not collected: the task never ran"
            tasks = tuple(
                TaskResult(
                    launch=j.launch,
                    task=j.task,
                    state=j.state,
                    why=j.why,
                    hint=hint,
                    skipped=tuple(SkippedArtifact(a, never) for a in j.artifacts),
                    params=dict(j.params) if j.params else None,
                )
                for j in fresh
            )
            exec_row = self.store.exec_sleep(key, seq)
            wake = gather.build_wake(
                sleep_id=sleep.id,
                seq=seq,
                created_at=sleep.created_at,
                woken_at=now,
                note=sleep.note,
                balance=balance,
                tasks=tasks,
                refunded_gpu_s=ledger.reserved_by(jobs),
                snapshot=exec_row.commit if exec_row is not None else None,
                launches=gather.launch_summaries(fresh, tasks, ws.policy.max_concurrent_gpus),
                error=ErrorInfo(code=error.code, message=error.message, path=None),
            )
            self.store.set_balance(key, balance)
            wake = telling.told(self.store, self.cfg, ws, wake)  # what of the contract changed, told once
            self.store.record_wake(key, seq, snapshot_ref(seq), encode(wake), render_wake(wake).encode())
            advanced = self.store.advance_sleep(key, seq, sleep.state, SleepEvent.GATHER)
            assert advanced, (key, seq, sleep.state)  # read in this transaction
        klog.event("gathered", ws=key, seq=seq, id=sleep.id, tasks=len(tasks), error=error.code)
        return True

    async def wake_unrun(self, key: str, seq: int, error: RequestError) -> None:
        """Wake an accepted sleep whose tasks cannot run (`_record_unrun`), refunded, then write its wake."""
        if not await self.worker.call(self._record_unrun, key, seq, error):
            return
        crash_point("gathered")
        if await self._write_wake(key, seq):
            await self.release(key, seq)

    def _wake_inputs(self, key: str, seq: int) -> tuple[WorkspaceRow, int, str, bytes, bytes, str] | None:
        """(store worker) The recorded wake of a gathered sleep: (workspace, the stamp of this read of its balance
        (kernel.io.budgetorder), sleep id, json, md, woken_at)."""
        sleep = self.store.sleep(key, seq)
        row = self.store.exec_sleep(key, seq)
        ws = self.store.workspace(key)
        if sleep is None or ws is None or row is None or not sleep_can(sleep.state, SleepEvent.WAKE):
            return None
        wake_json, wake_md = row.wake_json, row.wake_md
        assert wake_json is not None
        assert wake_md is not None
        stamp = self.store.budget_order.stamp()
        return ws, stamp, sleep.id, wake_json, wake_md, _wake_decoder.decode(wake_json).woken_at

    def _write_wake_files(
        self,
        ws: WorkspaceRow,
        stamp: int,
        seq: int,
        sleep_id: str,
        wake_json: bytes,
        wake_md: bytes,
        woken_at: str,
    ) -> bool:
        """(heavy pool; no store access) Write the wake and budget.json into the channel (budget.json in the order
        of the balances' reads: a newer balance already written stays)."""
        key = ws.key
        try:
            with safefs.open_channel(ws.path, ws.identity) as ch:
                try:
                    wakes = ch.subdir(ChannelPaths.WAKES)
                    try:
                        safefs.sweep_kernel_temps(wakes)  # a wake write cut short by a crash
                    finally:
                        os.close(wakes)
                    ch.write_file(ChannelPaths.WAKES, ChannelPaths.wake_json(sleep_id), wake_json)
                    ch.write_file(ChannelPaths.WAKES, ChannelPaths.wake_md(sleep_id), wake_md)
                except safefs.Refused as e:
                    # The agent blocked its own wake (a directory in the way): it stays in the store.
                    klog.event("wake_blocked", logging.WARNING, ws=key, seq=seq, reason=e.reason)
                self.store.budget_order.write(key, stamp, ws.balance, lambda b: write_budget(ch, b, woken_at))
        except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
            self._problem("wake_deferred", key, seq, f"{type(e).__name__}: {e}")
            return False
        return True

    def _record_woken(self, key: str, seq: int, sleep_id: str, woken_at: str) -> bool:
        """(store worker) The sleep -> woken, once its wake is written (idempotent)."""
        with self.store.transaction():
            if not self.store.advance_sleep(key, seq, "gathered", SleepEvent.WAKE, woken_at=woken_at):
                return False
        self._problems.pop((key, seq), None)
        jobs = sorted({j.job_id for j in self.store.jobs_of(key, seq) if j.job_id}, key=job_order)
        klog.event("woken", ws=key, seq=seq, id=sleep_id, jobs=",".join(jobs))
        return True

    async def _write_wake(self, key: str, seq: int) -> bool:
        """Write the recorded wake and budget.json, then move the sleep to woken (idempotent)."""
        got = await self.worker.call(self._wake_inputs, key, seq)
        if got is None:
            return False
        ws, stamp, sleep_id, wake_json, wake_md, woken_at = got
        if await self.worker.call(self._unenrolled, key):
            klog.event(
                "wake_not_written",
                ws=key,
                seq=seq,
                id=sleep_id,
                reason="the operator unenrolled the workspace; the wake is kept in the store",
            )
        elif not await self.heavy.run(
            key, self._write_wake_files, ws, stamp, seq, sleep_id, wake_json, wake_md, woken_at
        ):
            return False
        return await self.worker.call(self._record_woken, key, seq, sleep_id, woken_at)

    def _problem(self, name: str, key: str, seq: int, problem: str) -> None:
        if self._problems.get((key, seq)) != problem:
            self._problems[(key, seq)] = problem
            klog.event(name, logging.WARNING, ws=key, seq=seq, problem=problem)

    def unreleased(self) -> list[tuple[str, int]]:
        return self.store.unreleased_snapshots()

    def _mark_released(self, key: str, seq: int) -> None:
        with self.store.transaction():
            self.store.mark_released(key, seq)

    async def release(self, key: str, seq: int) -> None:
        """Release a woken sleep's snapshot ref in the kernel's repository, then record that it was."""
        ws = await self.worker.call(self.store.workspace, key)
        if ws is None:
            return
        try:
            # A git process in the workspace's repository: its heavy work (one job at a time, the deadline).
            await self.heavy.run(key, release_sync, KernelRepo.at(self.cfg.run_dir, key), seq)
        except (RepoError, OSError) as e:
            klog.event("snapshot_release_failed", logging.WARNING, ws=key, seq=seq, problem=str(e))
        await self.worker.call(self._mark_released, key, seq)

    async def maybe_gather(self, key: str, seq: int) -> None:
        """Gather the sleep if its last task has ended, then write its wake (both skipped when done already)."""
        if (key, seq) in self._gathering:
            return
        self._gathering.add((key, seq))
        try:
            got = await self.worker.call(self._gather_inputs, key, seq)
            if got is False:
                return
            if got is not True:
                ws, jobs, unenrolled = got
                results = await self.heavy.run(key, self._collect, ws, seq, jobs, unenrolled)
                if results is None:
                    return
                # What the verdict needs of the runs' directories: read here, not in the gather's store step.
                runs = await self.heavy.run(key, self.evaluation.read_runs, jobs)
                if not await self.worker.call(self._record_gather, key, seq, results, runs):
                    return
            crash_point("gathered")
            if await self._write_wake(key, seq):
                await self.release(key, seq)
        finally:
            self._gathering.discard((key, seq))
