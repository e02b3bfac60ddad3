"""Gathering and waking: a sleep whose last task has ended gets its artifacts, its refunds and its wake.

Step 3 of a sleep's life (kernel.service.execute): artifacts are delivered into `results/` (idempotent, heavy
pool), then ONE transaction releases the reservations (refunding what the measured elapsed time did not use),
asks the `Evaluation` strategy to judge the tasks (a submit's verdict), stores the wake's exact bytes and moves
the sleep to `gathered`. Only then are `wakes/<id>.json`, `wakes/<id>.md` and `budget.json` written (from the
stored bytes, so a restart rewrites the same wake), the sleep moves to `woken`, and the snapshot ref is released
(its objects go at the kernel repository's next gc). A channel that cannot be used now defers the step (logged
once per problem); it is retried at every tick.

A sleep with a `wake_on` (kernel.core.wakeon) may wake early, while some of its tasks still run. With `rest`
"run": the ended tasks are gathered and ONE transaction records their refunds, the early wake's bytes, the task
that met the condition and the tasks left running (the sleep -> `early_gathered`); the early wake is written to
`wakes/<id>.json` / `.md` (-> `early_woken`); once the rest has ended it is gathered as above, and its wake, every
task final, goes to `wakes/<id>.rest.json` / `.md` (-> `gathered` -> `woken`). Each wake file pair is written
from its stored bytes in its own state, so each is written once. With `rest` "cancel": the trigger and the tasks
still live are recorded first, then their cancel is sent (again once per kernel process while they live), and
the sleep wakes once, as any other, when they have stopped.

A workspace the operator unenrolled (`unenroll --force`, its sleep in flight: the executor cancels its jobs) has
no channel any more: its sleep is gathered from the run directories alone (artifacts not delivered, said so in
the stored wake) and ends `woken` with its wake kept in the store only (`event=wake_not_written`), so nothing waits
for a channel that is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from channel import safefs, sweep
from channel.decode import RequestError, parse_request
from channel.lifecycle import LIVE_TASK_STATES, TERMINAL_TASK_STATES, SleepEvent, TaskEvent, sleep_can
from channel.messages import ErrorInfo, JobRef, SkippedArtifact, SleepRequest, TaskResult, Wake, encode
from channel.paths import ChannelPaths
from channel.render import render_wake
from kernel.backends.base import DEFAULT_ARTIFACT_MAX_BYTES, RunnableBackend
from kernel.core import ledger, wakeon
from kernel.core.budget import Balance
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
from kernel.service.executor import ExecutorUnavailable
from kernel.service.gather import job_order
from kernel.service.heavy import HeavyPool

_wake_decoder: Final = msgspec.json.Decoder(Wake)

# What `collect` found for one task: (job, task dir, elapsed seconds, artifacts delivered and skipped).
Collected = tuple[JobRow, Path | None, float | None, gather.TaskFiles]
# The executor's ground truth for a sleep's tasks (kernel.service.tracking.Tracker.sweep), and its cancel of a
# sleep's live tasks (kernel.service.dispatch.Dispatcher.cancel_submitted, every launch).
Refresh = Callable[[list[tuple[str, int]]], Awaitable[object]]
CancelRest = Callable[[str, int], Awaitable[None]]
# How many steps one look takes a sleep through (an early wake, its files, the rest's gathering): enough for all.
_STEPS: Final = 4


@dataclass(frozen=True, slots=True)
class _Whole:
    """Every task to gather has ended: the sleep's tasks (`jobs`), or after an early wake the rest of them."""

    ws: WorkspaceRow
    jobs: list[JobRow]
    unenrolled: bool


@dataclass(frozen=True, slots=True)
class _Early:
    """`wake_on` met while tasks still run, `rest` "run": the tasks that ended (`ended`) are gathered now."""

    ws: WorkspaceRow
    ended: list[JobRow]


@dataclass(frozen=True, slots=True)
class _StopRest:
    """`wake_on` met while tasks still run, `rest` "cancel": `trigger` met it, `live` are to be cancelled."""

    trigger: tuple[str, int]
    live: tuple[tuple[str, int], ...]


def _ref(j: JobRow) -> tuple[str, int]:
    return (j.launch, j.task)


def _job_ref(key: tuple[str, int], jobs: list[JobRow]) -> JobRef:
    job_id = next((j.job_id for j in jobs if _ref(j) == key), None)
    return JobRef(launch=key[0], task=key[1], job_id=job_id)


class Waker:
    """Gathers a complete sleep and writes its wake (each step idempotent, each safe to repeat after a crash)."""

    def __init__(
        self,
        live: LiveConfig,
        worker: StoreWorker,
        backend: RunnableBackend,
        heavy: HeavyPool,
        evaluation: Evaluation,
        *,
        refresh: Refresh | None = None,
        cancel_rest: CancelRest | None = None,
    ) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.backend = backend
        self.heavy = heavy
        self.evaluation = evaluation
        self.refresh = refresh
        self.cancel_rest = cancel_rest
        self._gathering: set[tuple[str, int]] = set()
        self._problems: dict[tuple[str, int], str] = {}
        # Sleeps whose rest this process asked the backend to cancel (`rest` "cancel"): asked once per process.
        self._rest_cancelled: set[tuple[str, int]] = set()

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
            if s.state in ("submitted", "running", "early_gathered", "early_woken")
            and (a := admins.get(s.workspace)) is not None
            and a.unenrolled_at is not None
        ]

    def _unenrolled(self, key: str) -> bool:
        """(store worker) Whether the operator unenrolled the workspace: its channel is gone."""
        return self.store.admin(key).unenrolled_at is not None

    def _gather_inputs(self, key: str, seq: int) -> _Whole | _Early | _StopRest | str | None:
        """(store worker) The step the sleep is ready for: its wake to write ("gathered"), its early wake to
        write ("early_gathered"), its tasks (or the rest of them) to gather (`_Whole`), its early wake to gather
        (`_Early`), its rest to cancel (`_StopRest`); None when nothing is due."""
        sleep = self.store.sleep(key, seq)
        if sleep is None:
            return None
        if sleep.state in ("gathered", "early_gathered"):
            return sleep.state
        if not sleep_can(sleep.state, SleepEvent.GATHER):
            return None
        jobs = self.store.jobs_of(key, seq)
        ws = self.store.workspace(key)
        assert ws is not None
        unenrolled = self._unenrolled(key)
        live = [j for j in jobs if j.state not in TERMINAL_TASK_STATES]
        if sleep.state == "early_woken":
            rest = set(sleep.rest_tasks)
            return None if live else _Whole(ws, [j for j in jobs if _ref(j) in rest], unenrolled)
        if not live:
            return _Whole(ws, jobs, unenrolled)
        if sleep.state not in ("submitted", "running") or unenrolled:
            return None
        if sleep.rest == "cancel" and sleep.trigger is not None:
            return _StopRest(sleep.trigger, sleep.rest_tasks)
        trigger = wakeon.early_trigger(sleep.wake_on, jobs)
        if trigger is None:
            return None
        if sleep.rest == "cancel":
            return _StopRest(_ref(trigger), tuple(_ref(j) for j in live))
        return _Early(ws, [j for j in jobs if j.state in TERMINAL_TASK_STATES])

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
        """(store worker) Record the wake and the refunds of `results` (the sleep -> gathered). After an early
        wake `results` are the rest, and the wake (the rest's) lists every task: the early wake's entries of
        those it delivered, as it delivered them, and the rest as gathered now."""
        woken_at = timestamp()
        with self.store.transaction():
            sleep = self.store.sleep(key, seq)
            ws = self.store.workspace(key)
            assert sleep is not None
            assert ws is not None
            if not sleep_can(sleep.state, SleepEvent.GATHER):
                return sleep.state == "gathered"
            exec_row = self.store.exec_sleep(key, seq)
            early: dict[tuple[str, int], TaskResult] = {}
            if sleep.state == "early_woken":
                assert exec_row is not None, (key, seq)
                assert exec_row.wake_json is not None, (key, seq)
                rest = set(sleep.rest_tasks)
                early = {
                    (t.launch, t.task): t
                    for t in _wake_decoder.decode(exec_row.wake_json).tasks
                    if (t.launch, t.task) not in rest
                }
            fresh = {(j.launch, j.task): j for j in self.store.jobs_of(key, seq)}
            balance, refunded, gathered = self._settle(ws, fresh, results)
            tasks = [early.get(k) or gathered[k] for k in fresh]
            shown, verdict = self.evaluation.judge(sleep, tuple(tasks), runs)
            jobs = list(fresh.values())
            wake = gather.build_wake(
                sleep,
                woken_at=woken_at,
                balance=balance,
                tasks=shown,
                refunded_gpu_s=refunded,
                verdict=verdict,
                snapshot=exec_row.commit if exec_row is not None else None,
                launches=gather.launch_summaries(jobs, shown, ws.policy.max_concurrent_gpus),
                part="rest" if early else "whole",
                trigger=None if sleep.trigger is None else _job_ref(sleep.trigger, jobs),
                rest_tasks=tuple(_job_ref(k, jobs) for k in sleep.rest_tasks),
            )
            if verdict is not None:
                self.store.set_sleep_verdict(key, seq, encode(verdict))
            wake = self._record_wake(ws, seq, wake, balance)
            # woken_at is the wake's from here on: status and history show a gathered sleep as woken then
            advanced = self.store.advance_sleep(key, seq, sleep.state, SleepEvent.GATHER, woken_at=woken_at)
            assert advanced, (key, seq, sleep.state)  # read in this transaction
        klog.event("gathered", ws=key, seq=seq, id=sleep.id, tasks=len(results), part=wake.part)
        return True

    def _record_wake(self, ws: WorkspaceRow, seq: int, wake: Wake, balance: Balance) -> Wake:
        """(in the step's transaction) Record the workspace's new balance and the wake, told what of the contract
        changed since its last answer or wake (once: kernel.service.telling); the wake as recorded."""
        self.store.set_balance(ws.key, balance)
        wake = telling.told(self.store, self.cfg, ws, wake)
        self.store.record_wake(ws.key, seq, snapshot_ref(seq), encode(wake), render_wake(wake).encode())
        return wake

    def _settle(
        self, ws: WorkspaceRow, fresh: dict[tuple[str, int], JobRow], results: list[Collected]
    ) -> tuple[Balance, int, dict[tuple[str, int], TaskResult]]:
        """(store worker, in the gathering's transaction) Settle each task of `results` (`fresh`: the sleep's
        tasks as read in that transaction): its reservation released, its measured use spent, the rest refunded,
        the numbers of its last JSON line kept. The balance after, the GPU-seconds refunded and each task as the
        wake shows it."""
        balance = ws.balance
        refunded = 0
        gathered: dict[tuple[str, int], TaskResult] = {}
        for j, tdir, elapsed, files in results:
            cur = fresh[_ref(j)]
            settled = ledger.settle_task(balance, cur, elapsed)
            balance = settled.balance
            refunded += settled.refunded_gpu_s
            # updated_at stays the kernel's record of the last state change (rules.cancelled_by)
            self.store.release_job(ws.key, cur.seq, cur.launch, cur.task)
            memory = (default_task_mem_mb(self.cfg, cur.gpus), ws.policy.max_mem_mb)
            done = gather.task_result(cur, tdir, elapsed, files, self.cfg.environment.mode, memory)
            gathered[_ref(cur)] = done
            # what `history --metric` reads of the task later (the wake's bytes are not kept)
            self.store.set_job_metrics(ws.key, cur.seq, cur.launch, cur.task, sweep.numbers_of(done.result))
        return balance, refunded, gathered

    def _record_early(self, key: str, seq: int, results: list[Collected]) -> bool | None:
        """(store worker) Record the early wake of a sleep whose `wake_on` is met while tasks still run (`rest`
        "run"): the ended tasks' refunds (`results`), the wake's bytes, the task that met the condition and the
        tasks left running; the sleep -> early_gathered. True when recorded (or already); False when it is not
        due any more (the sleep moved, or every task ended: it is gathered whole); None when a task ended after
        `results` were collected (collected again)."""
        woken_at = timestamp()
        with self.store.transaction():
            sleep = self.store.sleep(key, seq)
            ws = self.store.workspace(key)
            assert sleep is not None
            assert ws is not None
            if sleep.state not in ("submitted", "running") or sleep.trigger is not None:
                return sleep.state == "early_gathered"
            jobs = self.store.jobs_of(key, seq)
            trigger = wakeon.early_trigger(sleep.wake_on, jobs)
            if trigger is None:
                return False
            collected = {_ref(j) for j, *_ in results}
            if collected != {_ref(j) for j in jobs if j.state in TERMINAL_TASK_STATES}:
                return None
            balance, refunded, gathered = self._settle(ws, {_ref(j): j for j in jobs}, results)
            live = wakeon.live(jobs)
            tasks = tuple(
                gathered.get(_ref(j))
                or TaskResult(
                    launch=j.launch,
                    task=j.task,
                    state=j.state,
                    job_id=j.job_id,
                    why=j.why,
                    params=dict(j.params) if j.params else None,
                )
                for j in jobs
            )
            exec_row = self.store.exec_sleep(key, seq)
            wake = gather.build_wake(
                sleep,
                woken_at=woken_at,
                balance=balance,
                tasks=tasks,
                refunded_gpu_s=refunded,
                snapshot=exec_row.commit if exec_row is not None else None,
                # a ranked launch's ranking holds the tasks that ended; those still running are listed as such
                launches=gather.launch_summaries(
                    jobs, tuple(gathered.values()), ws.policy.max_concurrent_gpus, names=tasks
                ),
                part="early",
                trigger=_job_ref(_ref(trigger), jobs),
                rest_tasks=tuple(_job_ref(_ref(j), jobs) for j in live),
            )
            wake = self._record_wake(ws, seq, wake, balance)
            recorded = self.store.set_sleep_trigger(key, seq, _ref(trigger), [_ref(j) for j in live])
            assert recorded, (key, seq)  # read in this transaction
            advanced = self.store.advance_sleep(
                key, seq, sleep.state, SleepEvent.GATHER_EARLY, woken_at=woken_at
            )
            assert advanced, (key, seq, sleep.state)  # read in this transaction
        klog.event(
            "gathered_early",
            ws=key,
            seq=seq,
            id=sleep.id,
            tasks=len(results),
            running=len(live),
            trigger=f"{trigger.launch}/{trigger.task}",
        )
        return True

    def _record_trigger(self, key: str, seq: int, stop: _StopRest) -> bool:
        """(store worker) Record, once, the task that met the sleep's `wake_on` and the tasks its `rest` "cancel"
        stops, before their cancel is sent (a restart sends it again). True when this call recorded them."""
        with self.store.transaction():
            recorded = self.store.set_sleep_trigger(key, seq, stop.trigger, stop.live)
        if recorded:
            klog.event(
                "rest_cancelling",
                ws=key,
                seq=seq,
                trigger=f"{stop.trigger[0]}/{stop.trigger[1]}",
                tasks=len(stop.live),
            )
        return recorded

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
                sleep,
                woken_at=now,
                balance=balance,
                tasks=tasks,
                refunded_gpu_s=ledger.reserved_by(jobs),
                snapshot=exec_row.commit if exec_row is not None else None,
                launches=gather.launch_summaries(fresh, tasks, ws.policy.max_concurrent_gpus),
                error=ErrorInfo(code=error.code, message=error.message, path=None),
            )
            wake = self._record_wake(ws, seq, wake, balance)
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

    def _wake_inputs(
        self, key: str, seq: int
    ) -> tuple[WorkspaceRow, int, str, tuple[str, str], bytes, bytes, str] | None:
        """(store worker) The recorded wake of a gathered sleep, or the early wake of one gathered early:
        (workspace, the stamp of this read of its balance (kernel.io.budgetorder), sleep id, the wake's two file
        names, json, md, woken_at). A gathered sleep that woke early has its rest's wake recorded, whose files
        are `<id>.rest.json` and `.md`."""
        sleep = self.store.sleep(key, seq)
        row = self.store.exec_sleep(key, seq)
        ws = self.store.workspace(key)
        if sleep is None or ws is None or row is None:
            return None
        if sleep.state == "early_gathered":
            names = (ChannelPaths.wake_json(sleep.id), ChannelPaths.wake_md(sleep.id))
        elif sleep_can(sleep.state, SleepEvent.WAKE):
            rest = sleep.trigger is not None and sleep.rest == "run"
            names = (
                (ChannelPaths.rest_wake_json(sleep.id), ChannelPaths.rest_wake_md(sleep.id))
                if rest
                else (ChannelPaths.wake_json(sleep.id), ChannelPaths.wake_md(sleep.id))
            )
        else:
            return None
        wake_json, wake_md = row.wake_json, row.wake_md
        assert wake_json is not None
        assert wake_md is not None
        stamp = self.store.budget_order.stamp()
        return ws, stamp, sleep.id, names, wake_json, wake_md, _wake_decoder.decode(wake_json).woken_at

    def _write_wake_files(
        self,
        ws: WorkspaceRow,
        stamp: int,
        seq: int,
        names: tuple[str, str],
        wake_json: bytes,
        wake_md: bytes,
        woken_at: str,
    ) -> bool:
        """(heavy pool; no store access) Write the wake (`names`: its json and md) and budget.json into the
        channel (budget.json in the order of the balances' reads: a newer balance already written stays)."""
        key = ws.key
        try:
            with safefs.open_channel(ws.path, ws.identity) as ch:
                try:
                    wakes = ch.subdir(ChannelPaths.WAKES)
                    try:
                        safefs.sweep_kernel_temps(wakes)  # a wake write cut short by a crash
                    finally:
                        os.close(wakes)
                    ch.write_file(ChannelPaths.WAKES, names[0], wake_json)
                    ch.write_file(ChannelPaths.WAKES, names[1], wake_md)
                except safefs.Refused as e:
                    # The agent blocked its own wake (a directory in the way): it stays in the store.
                    klog.event("wake_blocked", logging.WARNING, ws=key, seq=seq, reason=e.reason)
                self.store.budget_order.write(key, stamp, ws.balance, lambda b: write_budget(ch, b, woken_at))
        except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
            self._problem("wake_deferred", key, seq, f"{type(e).__name__}: {e}")
            return False
        return True

    def _record_woken(self, key: str, seq: int, sleep_id: str, woken_at: str) -> bool:
        """(store worker) The sleep -> woken once its wake is written, or -> early_woken once its early wake is
        (idempotent)."""
        with self.store.transaction():
            sleep = self.store.sleep(key, seq)
            early = sleep is not None and sleep.state == "early_gathered"
            if early:
                moved = self.store.advance_sleep(key, seq, "early_gathered", SleepEvent.WAKE_EARLY)
            else:
                moved = self.store.advance_sleep(key, seq, "gathered", SleepEvent.WAKE, woken_at=woken_at)
            if not moved:
                return False
        self._problems.pop((key, seq), None)
        jobs = self.store.jobs_of(key, seq)
        if early:
            running = sum(1 for j in jobs if j.state in LIVE_TASK_STATES)
            klog.event("woken_early", ws=key, seq=seq, id=sleep_id, running=running)
            return True
        ids = sorted({j.job_id for j in jobs if j.job_id}, key=job_order)
        klog.event("woken", ws=key, seq=seq, id=sleep_id, jobs=",".join(ids))
        return True

    async def _write_wake(self, key: str, seq: int) -> bool:
        """Write the recorded wake (or early wake) and budget.json, then move the sleep to woken (early_woken)
        (idempotent)."""
        got = await self.worker.call(self._wake_inputs, key, seq)
        if got is None:
            return False
        ws, stamp, sleep_id, names, wake_json, wake_md, woken_at = got
        if await self.worker.call(self._unenrolled, key):
            klog.event(
                "wake_not_written",
                ws=key,
                seq=seq,
                id=sleep_id,
                reason="the operator unenrolled the workspace; the wake is kept in the store",
            )
        elif not await self.heavy.run(
            key, self._write_wake_files, ws, stamp, seq, names, wake_json, wake_md, woken_at
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

    async def maybe_gather(self, key: str, seq: int) -> bool:
        """Take the sleep through every step it is ready for: its early wake (gathered, written), its rest's
        gathering or its whole gathering, and its wake (each skipped when done already); its rest's cancel
        (`rest` "cancel"). True when the sleep changed state."""
        if (key, seq) in self._gathering:
            return False
        self._gathering.add((key, seq))
        moved = False
        try:
            for _ in range(_STEPS):
                step = await self._step(key, seq)
                moved = moved or step
                if not step:
                    break
            return moved
        finally:
            self._gathering.discard((key, seq))

    async def _step(self, key: str, seq: int) -> bool:
        """One step of the sleep's waking; True when it changed the sleep's state and another may follow."""
        got = await self.worker.call(self._gather_inputs, key, seq)
        if isinstance(got, (_Early, _StopRest)) and self.refresh is not None:
            # Ends already in the run directories count: tasks that all failed at once wake the sleep once.
            await self.refresh([(key, seq)])
            got = await self.worker.call(self._gather_inputs, key, seq)
        if got is None:
            return False
        if got == "early_gathered":
            if not await self._write_wake(key, seq):
                return False
            crash_point("early_woken")
            return True
        if got == "gathered":
            if await self._write_wake(key, seq):
                await self.release(key, seq)
            return False
        if isinstance(got, _StopRest):
            await self._stop_rest(key, seq, got)
            return False
        if isinstance(got, _Early):
            results = await self.heavy.run(key, self._collect, got.ws, seq, got.ended)
            if results is None:
                return False
            recorded = await self.worker.call(self._record_early, key, seq, results)
            if recorded is None:
                return True  # a task ended meanwhile: collected again at the next step
            if not recorded:
                return False
            crash_point("early_gathered")
            return True
        assert isinstance(got, _Whole)
        self._rest_cancelled.discard((key, seq))
        results = await self.heavy.run(key, self._collect, got.ws, seq, got.jobs, got.unenrolled)
        if results is None:
            return False
        # What the verdict needs of the runs' directories: read here, not in the gather's store step.
        runs = await self.heavy.run(key, self.evaluation.read_runs, got.jobs)
        if not await self.worker.call(self._record_gather, key, seq, results, runs):
            return False
        crash_point("gathered")
        if await self._write_wake(key, seq):
            await self.release(key, seq)
        return True

    async def _stop_rest(self, key: str, seq: int, stop: _StopRest) -> None:
        """`rest` "cancel": record the trigger and the tasks to stop, then cancel them (once per process; a
        backend that cannot act now is asked again at the next look)."""
        await self.worker.call(self._record_trigger, key, seq, stop)
        if (key, seq) in self._rest_cancelled or self.cancel_rest is None:
            return
        crash_point("rest_cancel")
        try:
            await self.cancel_rest(key, seq)
        except ExecutorUnavailable as e:
            self._problem("rest_cancel_deferred", key, seq, str(e))
            return
        self._rest_cancelled.add((key, seq))
        klog.event("rest_cancel_sent", ws=key, seq=seq, tasks=len(stop.live))
