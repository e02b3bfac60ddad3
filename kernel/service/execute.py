"""The real executor: snapshot, submit, track, gather and wake, crash-safe at every step.

A sleep's life here (the pipeline has already recorded it `validated` with PENDING tasks and charged it):

1. dispatch: snapshot the workspace into the kernel's own repository of it (`<run_dir>/repos/<ws>.git`, ref
   `refs/snapshots/<seq>`; nothing is written into the agent's `.git`) and record the commit and tree with the
   sleep `snapshotted`; write each launch's run directory (`jobscript.write_launch`) and hand it to the backend
   (`submit` is idempotent per launch: a local launch already on disk or a Slurm job found by name is not
   submitted again); record every task's job id with the sleep `submitted`. A `SnapshotError` is the agent's
   (`DispatchRefused`, code `snapshot.failed`, the charge is refunded); a backend failure is the world's
   (`ExecutorUnavailable`, retried at the next rescan).
2. tracking: `backend.wait_any_exit` reports each task's end at once; a tick re-reads the exit files of every
   live task (the ground truth: events only make it faster) and marks tasks whose `started` file appeared
   RUNNING. Each end is recorded with its state, exit code, signal and times.
3. gathering, when the sleep's last task has ended: artifacts are delivered into `results/` (idempotent), then
   ONE transaction releases the reservations (refunding what the measured elapsed time did not use), stores the
   wake's exact bytes and moves the sleep to `gathered`. Only then are `wakes/<id>.json`, `wakes/<id>.md` and
   `budget.json` written (from the stored bytes, so a restart rewrites the same wake), the sleep moves to
   `woken`, and the snapshot ref is released (its objects go at the kernel repository's next gc).
4. recovery at start: `backend.recover(run_dir)` adopts what still runs; recorded ends, complete sleeps and
   gathered-but-unwritten wakes are finished from the store and the run directories. No task is submitted
   twice (the backend looks before it acts) and no wake is written with different content.

Extra tasks (e.g. a submit's evaluation runs) are ordinary job rows of the sleep: launches are built from the
sleep's job rows, not from the request, so whatever rows a sleep holds are dispatched, tracked and gathered.

`SYSCALL_KERNEL_CRASH_AT=<step>` (TEST ONLY, see `CRASH_STEPS`) makes the kernel SIGKILL itself at that step,
for the fault tests.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread
import msgspec

from channel import safefs
from channel.decode import RequestError, at_a_time
from channel.lifecycle import SleepEvent, TaskEvent, next_task_state
from channel.messages import (
    TERMINAL_TASK_STATES,
    JobRef,
    LockedEnvironment,
    SkippedArtifact,
    TaskResult,
    Verdict,
    Wake,
    encode,
)
from channel.paths import ChannelPaths
from channel.render import render_wake
from kernel.backends import jobscript
from kernel.backends.base import DEFAULT_ARTIFACT_MAX_BYTES, JobSpec, RunnableBackend, TaskExit
from kernel.core import retention
from kernel.core.budget import release
from kernel.core.config import Config
from kernel.core.records import JobRow, SleepRow, WorkspaceRow
from kernel.io import envcache, jobenv
from kernel.io import log as klog
from kernel.io import retention as rfiles
from kernel.io.crash import crash_point
from kernel.io.enroll import write_budget
from kernel.io.repo import KernelRepo, RepoError, snapshot_ref
from kernel.io.snapshot import Snapshot, SnapshotError, SnapshotTooLarge, snapshot_sync
from kernel.io.snapshot import release as release_snapshot
from kernel.io.store import StoreUnavailable, StoreWorker, timestamp
from kernel.node.jail import JailPolicy, JobEnvironment
from kernel.service import gather
from kernel.service.executor import (
    DispatchRefused,
    ExecutorUnavailable,
    SleepOrder,
)
from kernel.service.heavy import HeavyPool

T = TypeVar("T")

GC_LOOK_S: Final = 60.0  # how often the kernel looks for a repository due for gc
RETENTION_LOOK_S: Final = 600.0  # how often retention looks for evidence to prune (and once at start)
TICK_S: Final = 1.0
_wake_decoder: Final = msgspec.json.Decoder(Wake)


def _write_launches(specs: list[JobSpec]) -> None:
    for spec in specs:
        jobscript.write_launch(spec)


def _worlds_fault(e: Exception) -> bool:
    """A backend failure that is the world's (filesystem, scheduler down or refusing): retried later."""
    return isinstance(e, OSError) or type(e).__name__ == "SlurmSubmitError"


def _refused(e: Exception) -> bool:
    """A permanent refusal by the backend (kernel.backends.slurm.backend.SlurmRefused): answered, never retried."""
    return any(c.__name__ == "SlurmRefused" for c in type(e).__mro__)


def _split_key(key: str) -> tuple[str, int, str] | None:
    parts = key.split("/")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


# Called at gathering (worker thread, inside the gather transaction) with every task's result: returns the tasks
# the wake shows and the submit's verdict. The extension point for evaluation runs, which are extra job rows of
# the sleep (dispatched and tracked like any launch; `specs_of` may be overridden to give them an eval seed).
# What `_collect` found for one task: (job, task dir, elapsed seconds, artifacts delivered, artifacts skipped).
Collected = tuple[JobRow, Path | None, float | None, gather.TaskFiles]
Judge = Callable[[SleepRow, tuple[TaskResult, ...]], tuple[tuple[TaskResult, ...], Verdict | None]]


class RealExecutor:
    def __init__(
        self, cfg: Config, worker: StoreWorker, backend: RunnableBackend, *, judge: Judge | None = None
    ) -> None:
        self.cfg = cfg
        self.judge = judge
        self.worker = worker
        self.store = worker.store
        self.backend = backend
        self.tmp_dir = Path(cfg.state_dir) / "tmp"
        self._gathering: set[tuple[str, int]] = set()
        self._problems: dict[tuple[str, int], str] = {}
        # Snapshots, artifact copies and wake writes: never on the store worker (see kernel.service.heavy).
        self.heavy = HeavyPool()
        self.envs = envcache.EnvCache(cfg.environment, cfg.run_dir) if cfg.environment.mode == "uv" else None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.worker.call(fn, *args)

    # --- store helpers (worker thread) ----------------------------------------------------------------

    def _setup(self) -> None:
        self.tmp_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        Path(self.cfg.run_dir).mkdir(mode=0o700, parents=True, exist_ok=True)

    def _record_snapshot(self, key: str, seq: int, snap: Snapshot) -> None:
        with self.store.transaction():
            if not self.store.advance_sleep(key, seq, "validated", SleepEvent.SNAPSHOT):
                return  # refused meanwhile: the snapshot is not recorded
            self.store.record_snapshot(key, seq, snap.ref, snap.commit, snap.tree)

    def _record_submitted(
        self, key: str, seq: int, specs: dict[str, JobSpec], ids: dict[tuple[str, int], str]
    ) -> None:
        now = timestamp()
        with self.store.transaction():
            if not self.store.advance_sleep(key, seq, "snapshotted", SleepEvent.SUBMIT):
                return
            for j in self.store.jobs_of(key, seq):
                job_id = ids.get((j.launch, j.task))
                if job_id is not None and j.job_id is None:
                    tdir = str(specs[j.launch].task_dir(j.task))
                    self.store.update_job(
                        replace(j, backend=self.backend.name, job_id=job_id, run_dir=tdir, updated_at=now)
                    )

    # --- dispatch -------------------------------------------------------------------------------------

    def repo_of(self, key: str) -> KernelRepo:
        """The kernel's own repository of a workspace (snapshots and bases; never the agent's `.git`)."""
        return KernelRepo.at(self.cfg.run_dir, key)

    async def precheck(self, order: SleepOrder) -> None:
        """Before the snapshot of a validated sleep: an extension point (kernel.submitexec makes sure the base
        is held, refusing with `snapshot.failed` at no cost when it cannot be taken from the agent's `.git`)."""

    def prepare(self, order: SleepOrder, commit: str, tree: str) -> None:
        """Worker thread, once the snapshot is recorded and before any launch is built (idempotent: it runs again
        after a crash). An extension point: kernel.service.submitexec decides and records the submit's plan here."""

    def specs_of(
        self, order: SleepOrder, commit: str, tree: str, jobs: Sequence[JobRow]
    ) -> dict[str, JobSpec]:
        """One JobSpec per launch among the sleep's job rows (extra rows, e.g. evaluation runs, included)."""
        ws = order.workspace
        local = self.cfg.local if self.cfg.backend == "local" else None
        jail = JailPolicy(
            kind=self.cfg.jail,
            network=ws.policy.network,
            image=self.cfg.apptainer_image or None,
            hide=(self.cfg.state_dir,),
            ro_dirs=self.cfg.environment.extra_dirs,
            tmp_mb=local.tmp_mb if local is not None else 0,
            shm_mb=local.mem_mb // 2 if local is not None else 0,
            mem_mb=local.mem_mb if local is not None else 0,
            max_procs=local.max_procs if local is not None else 0,
        )
        specs: dict[str, JobSpec] = {}
        for j in jobs:
            if j.launch in specs:
                continue
            width = at_a_time(j.array_size, j.concurrency, j.gpus, ws.policy.max_concurrent_gpus)
            specs[j.launch] = JobSpec(
                workspace=ws.key,
                workspace_path=ws.path,
                seq=order.sleep.seq,
                launch=j.launch,
                run_dir=self.cfg.run_dir,
                command=j.command,
                commit=commit,
                tree=tree,
                minutes=j.minutes,
                array=j.array_size,
                concurrency=0 if width >= j.array_size else width,
                gpus=j.gpus,
                artifacts=j.artifacts,
                jail=jail,
                path_dirs=self.cfg.environment.extra_dirs,
                sleep_id=order.sleep.id,
                gpus_constrained=self.cfg.backend == "slurm",
            )
        return specs

    # --- locked environments ----------------------------------------------------------------------------

    async def _with_environments(
        self, order: SleepOrder, tree: str, specs: dict[str, JobSpec]
    ) -> dict[str, JobSpec]:
        """Give each launch the locked environment of the tree it runs (the sleep's snapshot `tree`, or a
        submit's base), built now if its cache is cold; raise DispatchRefused(environment.failed) when a
        lockfile cannot be installed: before anything is submitted."""
        ws = order.workspace
        by_tree: dict[str, tuple[envcache.EnvReady, JobEnvironment] | None] = {}
        for each in dict.fromkeys(spec.tree for spec in specs.values()):
            by_tree[each] = await self._environment(order, each)
        own = by_tree.get(tree)
        locked = None if own is None else jobenv.locked_of(own[0], timestamp())
        if self.envs is not None and specs:  # a checkpoint (no launch) says nothing about the environment
            await anyio.to_thread.run_sync(self._publish_jobenv, ws, locked)
        out = {}
        for name, spec in specs.items():
            found = by_tree[spec.tree]
            out[name] = msgspec.structs.replace(spec, environment=None if found is None else found[1])
        return out

    def _project_files(self, key: str, tree: str) -> dict[str, bytes]:
        """pyproject.toml and uv.lock at the root of a snapshot tree in the kernel's repository (those present)."""
        repo = self.repo_of(key)
        out = {}
        for name in (envcache.PROJECT_FILE, envcache.LOCK_FILE):
            data = repo.read_blob(tree, name)
            if data is not None:
                if len(data) > envcache.MAX_FILE_BYTES:
                    raise RepoError(
                        f"{name} is {len(data)} bytes, above the limit of {envcache.MAX_FILE_BYTES}"
                    )
                out[name] = data
        return out

    async def _environment(
        self, order: SleepOrder, tree: str
    ) -> tuple[envcache.EnvReady, JobEnvironment] | None:
        if self.envs is None:
            return None
        ws = order.workspace
        try:
            files = await anyio.to_thread.run_sync(self._project_files, ws.key, tree)
        except RepoError as e:
            raise DispatchRefused(
                RequestError("environment.failed", f"the locked environment: {e}", None)
            ) from None
        if envcache.LOCK_FILE not in files:
            return None
        if envcache.PROJECT_FILE not in files:
            raise DispatchRefused(
                RequestError(
                    "environment.failed",
                    "the snapshot has uv.lock but no pyproject.toml at its root; uv needs both (add pyproject.toml, "
                    "or remove uv.lock to run on the system's Python)",
                    None,
                )
            )
        project = envcache.LockedProject(
            pyproject=files[envcache.PROJECT_FILE], lock=files[envcache.LOCK_FILE]
        )
        try:
            ready, env, built = await self.envs.ensure(project)
        except envcache.EnvironmentFailed as e:
            klog.event(
                "environment_failed", logging.WARNING, ws=ws.key, seq=order.sleep.seq, error=str(e)[:500]
            )
            raise DispatchRefused(
                RequestError(
                    "environment.failed",
                    f"the workspace's uv.lock could not be installed, so nothing was submitted: {e}",
                    None,
                )
            ) from None
        klog.event(
            "environment_ready",
            ws=ws.key,
            seq=order.sleep.seq,
            key=env.cache.rsplit("/", 2)[-2],
            built=built,
            packages=len(ready.packages),
            warm_s=ready.warm_seconds if built else 0.0,
        )
        if built:
            removed = await anyio.to_thread.run_sync(self.envs.prune)
            if removed:
                klog.event("environment_pruned", caches=len(removed))
        return ready, env

    def _publish_jobenv(self, ws: WorkspaceRow, locked: LockedEnvironment | None) -> None:
        """Record the workspace's latest locked environment and rewrite its `jobenv.json` (a channel the agent
        broke only loses the file, never the sleep)."""
        jobenv.remember(self.cfg.run_dir, ws.key, locked)
        try:
            with safefs.open_channel(ws.path, ws.identity) as ch:
                jobenv.write(ch, jobenv.document(self.cfg, ws.policy, locked, timestamp()))
        except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
            klog.event("jobenv_unwritten", logging.WARNING, ws=ws.key, problem=f"{type(e).__name__}: {e}")

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        key, seq = order.workspace.key, order.sleep.seq
        sleep = await self._call(self.store.sleep, key, seq)
        assert sleep is not None
        if sleep.state == "validated":
            crash_point("recorded")
            try:
                await self.precheck(order)
                snap = await self.heavy.run(
                    key,
                    functools.partial(
                        snapshot_sync,
                        tmp_dir=self.tmp_dir,
                        max_total_bytes=self.cfg.snapshot.max_bytes,
                        max_files=self.cfg.snapshot.max_files,
                        max_depth=self.cfg.snapshot.max_depth,
                    ),
                    order.workspace.path,
                    self.repo_of(key),
                    seq,
                )
            except SnapshotTooLarge as e:
                raise DispatchRefused(RequestError("snapshot.too_large", str(e), None)) from None
            except SnapshotError as e:
                raise DispatchRefused(
                    RequestError("snapshot.failed", f"the workspace could not be snapshotted: {e}", None)
                ) from None
            except (OSError, RepoError) as e:
                raise ExecutorUnavailable(f"snapshot of {order.workspace.path}: {e}") from e
            await self._call(self._record_snapshot, key, seq, snap)
            klog.event("snapshotted", ws=key, seq=seq, commit=snap.commit[:12], files=snap.files)
            crash_point("snapshot")
            sleep = await self._call(self.store.sleep, key, seq)
            assert sleep is not None
        if sleep.state == "snapshotted":
            row = await self._call(self.store.exec_sleep, key, seq)
            assert row is not None, (key, seq)
            if not await self.heavy.run(key, self.repo_of(key).has_tree, row.tree):
                # Only an older kernel (snapshots in the agent's .git) stopped between snapshot and submit leaves
                # this: its jobs could only read the workspace's repository, which this kernel never does.
                raise DispatchRefused(
                    RequestError(
                        "snapshot.failed",
                        f"the snapshot recorded for this sleep ({row.tree[:12]}) is not in the kernel's repository "
                        "(an older kernel kept it in the workspace's .git, which is no longer read); sleep again",
                        None,
                    )
                )
            await self._call(self.prepare, order, row.commit, row.tree)
            jobs = await self._call(self.store.jobs_of, key, seq)
            specs = self.specs_of(order, row.commit, row.tree, [j for j in jobs if j.state == "PENDING"])
            specs = await self._with_environments(order, row.tree, specs)
            account = await self._call(self.store.slurm_account, key)
            if account is not None:
                specs = {n: msgspec.structs.replace(s, account=account) for n, s in specs.items()}
            ids: dict[tuple[str, int], str] = {}
            try:
                # Every run directory first, then every submit back to back: the launches start together.
                await anyio.to_thread.run_sync(_write_launches, list(specs.values()))
            except OSError as e:
                raise ExecutorUnavailable(f"writing the run directories of {key}/{seq}: {e}") from e
            done: list[JobSpec] = []
            for spec in specs.values():
                try:
                    refs = await self.backend.submit(spec)
                except Exception as e:
                    if _refused(e):
                        await self._refuse_partial(done, spec, e)
                    if _worlds_fault(e):
                        raise ExecutorUnavailable(f"submitting {spec.key}: {e}") from e
                    raise
                done.append(spec)
                for r in refs:
                    ids[(spec.launch, r.task)] = r.job_id
            crash_point("submit")
            await self._call(self._record_submitted, key, seq, specs, ids)
            klog.event(
                "submitted",
                ws=key,
                seq=seq,
                launches=len(specs),
                tasks=len(ids),
                jobs=",".join(sorted({i for i in ids.values() if i}, key=_job_order)),
            )
        jobs = await self._call(self.store.jobs_of, key, seq)
        # Tasks that ended while the kernel was down (or before their ids were recorded), and a checkpoint.
        await self._call(self._sweep_sleep, key, seq)
        await self._maybe_gather(key, seq)
        return tuple(JobRef(launch=j.launch, task=j.task, job_id=j.job_id) for j in jobs)

    async def _refuse_partial(self, done: list[JobSpec], spec: JobSpec, e: Exception) -> None:
        """The backend refused `spec` for good: cancel the launches already submitted (never half a sleep), then
        reject the sleep with `backend.refused` (the pipeline refunds it)."""
        for other in done:
            await self.backend.cancel(other.key)
        klog.event("dispatch_refused", logging.WARNING, launch=spec.key, cancelled=len(done), error=str(e))
        detail = getattr(e, "detail", str(e))
        raise DispatchRefused(
            RequestError(
                "backend.refused",
                f"the scheduler refused launch {spec.launch!r}: {detail}; nothing of this sleep runs "
                "and its charge is refunded",
                None,
            )
        ) from None

    # --- cancel ---------------------------------------------------------------------------------------

    async def cancel(self, order: SleepOrder, launches: tuple[str, ...]) -> None:
        key, seq = order.workspace.key, order.sleep.seq
        jobs = await self._call(self.store.jobs_of, key, seq)
        wanted = set(launches) or {j.launch for j in jobs}
        tasks: dict[str, list[int]] = {}
        for j in jobs:
            if j.launch in wanted and j.job_id is not None and j.state in ("PENDING", "RUNNING"):
                tasks.setdefault(j.launch, []).append(j.task)
        for launch, ts in tasks.items():
            try:
                stopped = await self.backend.cancel(f"{key}/{seq}/{launch}", ts)
            except Exception as e:
                if _worlds_fault(e):
                    raise ExecutorUnavailable(f"cancelling {key}/{seq}/{launch}: {e}") from e
                raise
            klog.event("cancel_sent", ws=key, seq=seq, launch=launch, tasks=len(stopped))
        # Work that ends from here on is gathered as usual; a sleep whose tasks had all ended wakes now.
        await self._maybe_gather(key, seq)

    # --- tracking -------------------------------------------------------------------------------------

    def _record_exit(self, key: str, seq: int, launch: str, task: int, task_dir: Path) -> bool:
        """Record a task's end from its exit record; True if this call recorded it."""
        rec = jobscript.read_exit(task_dir)
        if rec is None:
            return False
        out = gather.outcome(rec)
        started, ended = gather.task_times(task_dir)
        now = timestamp()
        with self.store.transaction():
            job = next(
                (j for j in self.store.jobs_of(key, seq) if j.launch == launch and j.task == task), None
            )
            if job is None or job.state in TERMINAL_TASK_STATES:
                return False
            state = next_task_state(job.state, out.event, out.state)
            self.store.update_job(
                replace(
                    job,
                    state=state,
                    exit_code=out.exit_code,
                    signal=out.signal,
                    started_at=timestamp(started) if started is not None else job.started_at,
                    ended_at=timestamp(ended) if ended is not None else now,
                    run_dir=str(task_dir),
                    updated_at=now,
                )
            )
        klog.event(
            "task_ended",
            ws=key,
            seq=seq,
            launch=launch,
            task=task,
            job=job.job_id,
            state=state,
            code=out.exit_code,
        )
        return True

    def _sweep_sleep(self, key: str, seq: int) -> list[JobRow]:
        """Ground truth for one sleep: record ends whose exit file is there; mark started tasks RUNNING."""
        changed = []
        for j in self.store.jobs_of(key, seq):
            if j.state not in ("PENDING", "RUNNING") or j.run_dir is None:
                continue
            tdir = Path(j.run_dir)
            if self._record_exit(key, seq, j.launch, j.task, tdir):
                changed.append(j)
            elif j.state == "PENDING" and (tdir / jobscript.NAMES.STARTED).exists():
                self._mark_running(j, tdir)
        return changed

    def _mark_running(self, job: JobRow, tdir: Path) -> None:
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
            if fresh is None or fresh.state != "PENDING":
                return
            self.store.update_job(
                replace(
                    fresh,
                    state=next_task_state("PENDING", TaskEvent.START),
                    started_at=timestamp(started) if started is not None else now,
                    updated_at=now,
                )
            )
            # The first task seen running moves the sleep on; a later one finds it moved already.
            self.store.advance_sleep(job.workspace, job.seq, "submitted", SleepEvent.START)

    def _live_sleeps(self) -> list[tuple[str, int]]:
        return [
            (s.workspace, s.seq)
            for s in self.store.live_sleeps()
            if s.state in ("submitted", "running", "gathered")
        ]

    def _sweep_all(self) -> list[tuple[str, int]]:
        out = []
        for key, seq in self._live_sleeps():
            self._sweep_sleep(key, seq)
            out.append((key, seq))
        return out

    async def _on_exit(self, ex: TaskExit) -> None:
        parsed = _split_key(ex.key)
        if parsed is None:
            return
        key, seq, launch = parsed
        recorded = await self._call(self._record_exit, key, seq, launch, ex.task, Path(ex.task_dir))
        if recorded:
            live = await self._call(self.store.jobs_of, key, seq)
            if any(j.state in ("PENDING", "RUNNING") for j in live):
                crash_point("task_end")
        await self._maybe_gather(key, seq)

    async def _tick(self) -> None:
        for key, seq in await self._call(self._sweep_all):
            await self._maybe_gather(key, seq)
        for key, seq in await self._call(self._unreleased):
            await self._release(key, seq)

    # --- gathering and waking -------------------------------------------------------------------------

    def _gather_inputs(self, key: str, seq: int) -> tuple[WorkspaceRow, list[JobRow]] | bool:
        """(store worker) What gathering needs, once every task has ended; True if already gathered, False if
        not ready."""
        sleep = self.store.sleep(key, seq)
        if sleep is None or sleep.state not in ("submitted", "running"):
            return sleep is not None and sleep.state == "gathered"
        jobs = self.store.jobs_of(key, seq)
        if any(j.state not in TERMINAL_TASK_STATES for j in jobs):
            return False
        ws = self.store.workspace(key)
        assert ws is not None
        return ws, jobs

    def _collect(self, ws: WorkspaceRow, seq: int, jobs: list[JobRow]) -> list[Collected] | None:
        """(heavy pool; no store access) Deliver every task's artifacts into the channel; None if the channel
        cannot be used now (retried at every tick)."""
        key = ws.key
        results: list[Collected] = []
        try:
            with safefs.open_channel(ws.path, ws.identity) as ch:
                for j in jobs:
                    tdir = Path(j.run_dir) if j.run_dir else None
                    if tdir is not None and jobscript.read_exit(tdir) is None:
                        tdir = None  # cancelled before it was ever handed over
                    elapsed = None
                    if tdir is not None:
                        started, ended = gather.task_times(tdir)
                        if started is not None and ended is not None:
                            elapsed = round(max(0.0, ended - started), 3)
                        files = gather.deliver_task(
                            ch, j, tdir, DEFAULT_ARTIFACT_MAX_BYTES, self.cfg.log_max_bytes
                        )
                    else:
                        files = gather.TaskFiles(
                            skipped=tuple(
                                SkippedArtifact(a, "not collected: the task never ran") for a in j.artifacts
                            )
                        )
                    results.append((j, tdir, elapsed, files))
        except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
            # Retried at every tick until the channel is usable again; logged once per problem.
            self._problem("gather_deferred", key, seq, f"{type(e).__name__}: {e}")
            return None
        return results

    def _record_gather(self, key: str, seq: int, results: list[Collected]) -> bool:
        """(store worker) Record the wake and the refunds (the sleep -> gathered)."""
        woken_at = timestamp()
        with self.store.transaction():
            sleep = self.store.sleep(key, seq)
            ws = self.store.workspace(key)
            assert sleep is not None
            assert ws is not None
            if sleep.state not in ("submitted", "running"):
                return sleep.state == "gathered"
            balance = ws.balance
            refunded = 0
            tasks = []
            fresh = {(j.launch, j.task): j for j in self.store.jobs_of(key, seq)}
            for j, tdir, elapsed, files in results:
                cur = fresh[(j.launch, j.task)]
                cost = cur.gpus * cur.minutes * 60
                used = min(gather.gpu_seconds_used(cur.gpus, elapsed), cost)
                if cur.reserved_gpu_s > 0:
                    balance = release(balance, cur.reserved_gpu_s, used)
                    # updated_at stays the kernel's record of the last state change (rules.cancelled_by)
                    self.store.update_job(replace(cur, reserved_gpu_s=0))
                refunded += cost - used
                tasks.append(gather.task_result(cur, tdir, elapsed, files, self.backend.hint_of))
            shown, verdict = (tuple(tasks), None) if self.judge is None else self.judge(sleep, tuple(tasks))
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
            self.store.record_wake(key, seq, snapshot_ref(seq), encode(wake), render_wake(wake).encode())
            advanced = self.store.advance_sleep(key, seq, sleep.state, SleepEvent.GATHER)
            assert advanced, (key, seq, sleep.state)  # read in this transaction
        klog.event("gathered", ws=key, seq=seq, id=sleep.id, tasks=len(tasks))
        return True

    def _wake_inputs(self, key: str, seq: int) -> tuple[WorkspaceRow, str, bytes, bytes, str] | None:
        """(store worker) The recorded wake of a gathered sleep: (workspace, sleep id, json, md, woken_at)."""
        sleep = self.store.sleep(key, seq)
        row = self.store.exec_sleep(key, seq)
        ws = self.store.workspace(key)
        if sleep is None or ws is None or row is None or sleep.state != "gathered":
            return None
        wake_json, wake_md = row.wake_json, row.wake_md
        assert wake_json is not None
        assert wake_md is not None
        return ws, sleep.id, wake_json, wake_md, _wake_decoder.decode(wake_json).woken_at

    def _write_wake_files(
        self, ws: WorkspaceRow, seq: int, sleep_id: str, wake_json: bytes, wake_md: bytes, woken_at: str
    ) -> bool:
        """(heavy pool; no store access) Write the wake and budget.json into the channel."""
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
                write_budget(ch, ws.balance, woken_at)
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
        jobs = sorted({j.job_id for j in self.store.jobs_of(key, seq) if j.job_id}, key=_job_order)
        klog.event("woken", ws=key, seq=seq, id=sleep_id, jobs=",".join(jobs))
        return True

    async def _write_wake(self, key: str, seq: int) -> bool:
        """Write the recorded wake and budget.json, then move the sleep to woken (idempotent)."""
        got = await self._call(self._wake_inputs, key, seq)
        if got is None:
            return False
        ws, sleep_id, wake_json, wake_md, woken_at = got
        if not await self.heavy.run(
            key, self._write_wake_files, ws, seq, sleep_id, wake_json, wake_md, woken_at
        ):
            return False
        return await self._call(self._record_woken, key, seq, sleep_id, woken_at)

    def _problem(self, name: str, key: str, seq: int, problem: str) -> None:
        if self._problems.get((key, seq)) != problem:
            self._problems[(key, seq)] = problem
            klog.event(name, logging.WARNING, ws=key, seq=seq, problem=problem)

    def _unreleased(self) -> list[tuple[str, int]]:
        return self.store.unreleased_snapshots()

    def _mark_released(self, key: str, seq: int) -> None:
        with self.store.transaction():
            self.store.mark_released(key, seq)

    async def _release(self, key: str, seq: int) -> None:
        ws = await self._call(self.store.workspace, key)
        if ws is None:
            return
        try:
            await release_snapshot(self.repo_of(key), seq)
        except (RepoError, OSError) as e:
            klog.event("snapshot_release_failed", logging.WARNING, ws=key, seq=seq, problem=str(e))
        await self._call(self._mark_released, key, seq)

    async def _maybe_gather(self, key: str, seq: int) -> None:
        if (key, seq) in self._gathering:
            return
        self._gathering.add((key, seq))
        try:
            got = await self._call(self._gather_inputs, key, seq)
            if got is False:
                return
            if got is not True:
                ws, jobs = got
                results = await self.heavy.run(key, self._collect, ws, seq, jobs)
                if results is None or not await self._call(self._record_gather, key, seq, results):
                    return
            crash_point("gathered")
            if await self._write_wake(key, seq):
                await self._release(key, seq)
        finally:
            self._gathering.discard((key, seq))

    # --- service hooks --------------------------------------------------------------------------------

    async def recover(self) -> None:
        await self._call(self._setup)
        found = await self.backend.recover(self.cfg.run_path)
        klog.event(
            "backend_recovered",
            backend=self.backend.name,
            running=len(found.running),
            finished=len(found.finished),
            requeued=len(found.requeued),
            lost=len(found.lost),
        )
        await self._tick()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.backend.run)
            tg.start_soon(self._exit_loop)
            tg.start_soon(self._gc_loop)
            if self.cfg.retention_days > 0 or self.cfg.retention_sleeps > 0:
                tg.start_soon(self._retention_loop)
            while True:
                await anyio.sleep(TICK_S)
                # A store that cannot be written (logged by the worker) only delays the tick's work.
                with contextlib.suppress(StoreUnavailable):
                    await self._tick()

    async def _gc_loop(self) -> None:
        """Each workspace's kernel repository is packed and pruned every `repo_gc_hours`, one at a time, off the
        hot path (held bases and unreleased snapshots are refs, so they stay)."""
        while True:
            await anyio.sleep(GC_LOOK_S)
            for ws in await self._call(self.store.workspaces):
                repo = self.repo_of(ws.key)
                if not repo.gc_due(self.cfg.repo_gc_hours * 3600):
                    continue
                try:
                    await self.heavy.run(ws.key, repo.gc)
                    klog.event("repo_gc", ws=ws.key)
                except (RepoError, OSError) as e:
                    klog.event("repo_gc_failed", logging.WARNING, ws=ws.key, problem=str(e)[:300])

    async def _retention_loop(self) -> None:
        while True:
            with contextlib.suppress(StoreUnavailable):
                await self.prune_once()
            await anyio.sleep(RETENTION_LOOK_S)

    async def prune_once(self) -> int:
        """Prune what retention lets go, workspace by workspace; the number of sleeps pruned. A sleep's files go
        first (heavy pool), then its records say so: a kernel stopped between the two prunes it again, finding
        less to remove."""
        now = datetime.now(UTC)
        pruned = 0
        for ws in await self._call(self.store.workspaces):
            ages = await self._call(self.store.sleep_ages, ws.key)
            seqs = retention.to_prune(
                [retention.SleepAge(seq, state, _when(woken or made)) for seq, state, made, woken in ages],
                keep_sleeps=self.cfg.retention_sleeps,
                keep_days=self.cfg.retention_days,
                now=now,
            )
            for seq in seqs:
                try:
                    run_b = await self.heavy.run(ws.key, rfiles.remove_run_dir, self.cfg.run_dir, ws.key, seq)
                    res_b = await self.heavy.run(ws.key, rfiles.remove_results, ws, seq)
                except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
                    klog.event("prune_failed", logging.WARNING, ws=ws.key, seq=seq, problem=str(e)[:300])
                    break  # this workspace waits for the next look; the others go on
                await self._call(self._record_pruned, ws.key, seq, run_b, res_b)
                klog.event("pruned", ws=ws.key, seq=seq, run_bytes=run_b, result_bytes=res_b)
                pruned += 1
            if self.cfg.retention_days > 0:
                cutoff = timestamp((now - timedelta(days=self.cfg.retention_days)).timestamp())
                gone = await self._call(self._prune_requests, ws.key, cutoff)
                if gone:
                    klog.event("requests_pruned", ws=ws.key, count=gone)
        return pruned

    def _record_pruned(self, key: str, seq: int, run_bytes: int, result_bytes: int) -> None:
        with self.store.transaction():
            self.store.record_pruned(key, seq, timestamp(), run_bytes, result_bytes)
            # The stored wake bytes served only to (re)write the wake; a woken sleep's are on disk.
            self.store.drop_wake_bytes(key, seq)

    def _prune_requests(self, key: str, cutoff: str) -> int:
        with self.store.transaction():
            return self.store.prune_read_requests(key, cutoff)

    async def _exit_loop(self) -> None:
        while True:
            try:
                ex = await self.backend.wait_any_exit()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return
            while True:
                try:
                    await self._on_exit(ex)
                    break
                except StoreUnavailable:
                    # The end must be recorded before anything else happens to the task: try again.
                    await anyio.sleep(TICK_S)


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _job_order(job_id: str) -> tuple[int, str]:
    """Job ids in submission order for log lines (numeric where they are: `99` before `100`)."""
    head = job_id.split("_")[0].split(".")[0]
    return (int(head) if head.isdigit() else 0, job_id)
