"""Dispatch: a recorded, charged sleep becomes a snapshot in the kernel's repository and submitted launches.

Step 1 of a sleep's life (kernel.service.execute): snapshot the workspace into the kernel's own repository of it
(`<run_dir>/repos/<ws>.git`, ref `refs/snapshots/<seq>`; nothing is written into the agent's `.git`) and record
the commit and tree with the sleep `snapshotted`; write each launch's run directory (`jobscript.write_launch`) and
hand it to the backend (`submit` is idempotent per launch: a local launch already on disk or a Slurm job found by
name is not submitted again); record every task's job id with the sleep `submitted`. A `SnapshotError` is the
agent's (`DispatchRefused`, code `snapshot.failed`, or `snapshot.too_large` past a limit; the charge is refunded),
a tree git cannot list included (a FIFO `.gitignore`, the listing's deadline: kernel.io.gitlisting), so it is
answered at once and never retried as an outage; so is a `BackendRefused` (code
`backend.refused`: the launches already submitted are cancelled, the charge refunded); a `BackendUnavailable`
is the world's (`ExecutorUnavailable`, retried later with a per-workspace backoff). Cancelling sends the backend's cancel for submitted tasks.

Launches are built from the sleep's job rows, not from the request, so whatever rows a sleep holds (a submit's
evaluation runs included) are dispatched; the `Evaluation` strategy decides its plan (`prepare`) and adjusts
those launches' specs (`specs`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import NoReturn

import msgspec

from channel import safefs
from channel.decode import RequestError
from channel.lifecycle import LIVE_TASK_STATES, SleepEvent, sleep_can
from channel.messages import JobRef, LockedEnvironment
from kernel.backends import jobscript
from kernel.backends.base import BackendRefused, BackendUnavailable, JobSpec, RunnableBackend
from kernel.core import rules
from kernel.core.config import Config, LiveConfig
from kernel.core.records import JobRow, WorkspaceRow
from kernel.io import crash, envcache, jobenv
from kernel.io import log as klog
from kernel.io.crash import crash_point
from kernel.io.repo import KernelRepo, RepoError
from kernel.io.snapshot import Snapshot, SnapshotError, SnapshotTooLarge, listing_jail, snapshot_sync
from kernel.io.store import StoreWorker, timestamp
from kernel.node.jail import JailPolicy, JobEnvironment, with_resources
from kernel.service.building import EnvironmentsCold
from kernel.service.evaluation import Evaluation
from kernel.service.executor import DispatchRefused, ExecutorUnavailable, SleepOrder
from kernel.service.gather import job_order
from kernel.service.heavy import HeavyPool


def _write_launches(specs: list[JobSpec]) -> None:
    for spec in specs:
        crash.hang_point("launches", spec.workspace_path)
        jobscript.write_launch(spec)


class Dispatcher:
    """Snapshot, build, submit and cancel a sleep's launches (recording each step in the store)."""

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
        cfg = live.current  # what chose a resource at start (kept on SIGHUP: kernel.service.reload)
        self.tmp_dir = cfg.paths.tmp
        build_jail = JailPolicy(kind=cfg.jail, hide=(cfg.state_dir,), ro_dirs=cfg.environment.extra_dirs)
        self.envs = (
            envcache.EnvCache(cfg.environment, cfg.paths.envs, jail=build_jail)
            if cfg.environment.mode == "uv"
            else None
        )
        # Sleeps whose dispatch found an environment cold (built in the background since): their next dispatch
        # logs `environment_ready built=True`.
        self.waited: set[tuple[str, int]] = set()
        self.listing_jail = listing_jail(cfg)
        if self.listing_jail is None:
            klog.event(
                "snapshot_listing_unjailed",
                logging.WARNING,
                jail=cfg.jail,
                note="git lists each workspace's live tree on the kernel's host without a jail; its deadline, "
                "blocked-open watch and caps still apply",
            )

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    def repo_of(self, key: str) -> KernelRepo:
        """The kernel's own repository of a workspace (snapshots and bases; never the agent's `.git`)."""
        return KernelRepo.at(self.cfg.run_dir, key)

    # --- store helpers (worker thread) ----------------------------------------------------------------

    def _record_snapshot(self, key: str, seq: int, snap: Snapshot) -> None:
        with self.store.transaction():
            if not self.store.advance_sleep(key, seq, "validated", SleepEvent.SNAPSHOT):
                return  # refused meanwhile: the snapshot is not recorded
            self.store.record_snapshot(key, seq, snap.ref, snap.commit, snap.tree)

    def _record_submitted(
        self, key: str, seq: int, specs: dict[str, JobSpec], ids: dict[tuple[str, int], str]
    ) -> dict[str, list[int]]:
        """Record the job ids (the sleep -> submitted); the tasks submitted whose rows ended meanwhile (the agent
        cancelled a sleep answered while its environment was built), by launch: the caller cancels them."""
        now = timestamp()
        stray: dict[str, list[int]] = {}
        with self.store.transaction():
            rows = self.store.jobs_of(key, seq)
            if not self.store.advance_sleep(key, seq, "snapshotted", SleepEvent.SUBMIT):
                for j in rows:
                    if (j.launch, j.task) in ids and j.job_id is None:
                        stray.setdefault(j.launch, []).append(j.task)
                return stray
            for j in rows:
                job_id = ids.get((j.launch, j.task))
                if job_id is not None and j.job_id is None and j.state != "PENDING":
                    stray.setdefault(j.launch, []).append(j.task)
                elif job_id is not None and j.job_id is None:
                    tdir = str(specs[j.launch].task_dir(j.task))
                    self.store.place_job(
                        key,
                        seq,
                        j.launch,
                        j.task,
                        backend=self.backend.name,
                        job_id=job_id,
                        run_dir=tdir,
                        at=now,
                    )
        return stray

    # --- launches --------------------------------------------------------------------------------------

    def specs_of(
        self,
        order: SleepOrder,
        commit: str,
        tree: str,
        jobs: Sequence[JobRow],
        every: Sequence[JobRow] = (),
    ) -> dict[str, JobSpec]:
        """One JobSpec per launch among the sleep's job rows (extra rows, e.g. evaluation runs, included); a swept
        launch's values per task come from `every` (all of the sleep's rows: `jobs` may be some of them)."""
        grids: dict[str, dict[int, tuple[tuple[str, str], ...]]] = {}
        for j in (*every, *jobs):
            if j.params:
                grids.setdefault(j.launch, {})[j.task] = j.params
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
            tree_mb=local.tree_mb if local is not None else 0,
        )
        specs: dict[str, JobSpec] = {}
        for j in jobs:
            if j.launch in specs:
                continue
            specs[j.launch] = JobSpec(
                mem_mb=j.mem_mb,
                cpus=j.cpus,
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
                concurrency=rules.array_throttle(j, ws.policy.max_concurrent_gpus),  # decided at acceptance
                gpus=j.gpus,
                artifacts=j.artifacts,
                params=_task_params(grids.get(j.launch, {}), j.array_size),
                jail=jail if local is None else with_resources(jail, j.mem_mb, j.cpus),
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
        submit's base). Raise DispatchRefused(environment.failed) when a lockfile will not be installed, or
        (environment.lock_outdated) when uv's check finds it out of date with its pyproject.toml, and
        EnvironmentsCold when a cache entry is not built yet: before anything is submitted."""
        ws = order.workspace
        by_tree: dict[str, envcache.Prepared | None] = {}
        for each in dict.fromkeys(spec.tree for spec in specs.values()):
            by_tree[each] = await self._environment(order, each)
        assert self.envs is not None or not any(by_tree.values())
        cold = [
            p
            for p in dict.fromkeys(by_tree.values())
            if p is not None and self.envs and not self.envs.ready(p.key)
        ]
        for p in cold:  # uv's own check, once per entry: a ready one passed it before its build
            await self._check(order, p)
        if cold:
            self.waited.add((ws.key, order.sleep.seq))
            raise EnvironmentsCold(cold)
        found: dict[str, tuple[envcache.EnvReady, JobEnvironment] | None] = {}
        for each, prepared in by_tree.items():
            found[each] = None if prepared is None else self._warm_entry(order, prepared)
        self.waited.discard((ws.key, order.sleep.seq))
        own = found.get(tree)
        locked = None if own is None else jobenv.locked_of(own[0], timestamp())
        if self.envs is not None and specs:  # a checkpoint (no launch) says nothing about the environment
            await self.heavy.run(ws.key, self._publish_jobenv, ws, locked)  # the workspace's channel
        out = {}
        for name, spec in specs.items():
            got = found[spec.tree]
            out[name] = msgspec.structs.replace(spec, environment=None if got is None else got[1])
        return out

    def _warm_entry(
        self, order: SleepOrder, prepared: envcache.Prepared
    ) -> tuple[envcache.EnvReady, JobEnvironment]:
        """The ready entry of `prepared` (checked by the caller), marked used."""
        assert self.envs is not None
        ready = self.envs.ready(prepared.key)
        assert ready is not None, prepared.key
        self.envs.touch(prepared.key)
        env = self.envs.job_environment(prepared.key, prepared.project)
        built = (order.workspace.key, order.sleep.seq) in self.waited
        klog.event(
            "environment_ready",
            ws=order.workspace.key,
            seq=order.sleep.seq,
            key=prepared.key,
            built=built,
            packages=len(ready.packages),
            warm_s=ready.warm_seconds if built else 0.0,
        )
        return ready, env

    async def _check(self, order: SleepOrder, prepared: envcache.Prepared) -> None:
        assert self.envs is not None
        try:
            await self.envs.check_lock(prepared)
        except envcache.LockOutdated as e:
            klog.event(
                "environment_lock_outdated", ws=order.workspace.key, seq=order.sleep.seq, error=str(e)[:500]
            )
            raise DispatchRefused(RequestError("environment.lock_outdated", str(e), None)) from None

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

    async def _environment(self, order: SleepOrder, tree: str) -> envcache.Prepared | None:
        """The accepted project of the tree's uv.lock (None: the tree has none, or the kernel builds none)."""
        if self.envs is None:
            return None
        ws = order.workspace
        try:
            files = await self.heavy.run(ws.key, self._project_files, ws.key, tree)
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
            return await self.envs.prepare(project)
        except envcache.EnvironmentFailed as e:
            klog.event(
                "environment_failed", logging.WARNING, ws=ws.key, seq=order.sleep.seq, error=str(e)[:500]
            )
            if isinstance(e, envcache.LockOutdated):
                raise DispatchRefused(RequestError("environment.lock_outdated", str(e), None)) from None
            raise DispatchRefused(
                RequestError(
                    "environment.failed",
                    f"the workspace's uv.lock could not be installed, so nothing was submitted: {e}",
                    None,
                )
            ) from None

    def _publish_jobenv(self, ws: WorkspaceRow, locked: LockedEnvironment | None) -> None:
        """Record the workspace's latest locked environment and rewrite its `jobenv.json` (a channel the agent
        broke only loses the file, never the sleep)."""
        jobenv.remember(self.cfg.paths.envs, ws.key, locked)
        try:
            with safefs.open_channel(ws.path, ws.identity) as ch:
                jobenv.write(ch, jobenv.document(self.cfg, ws.policy, locked, timestamp()))
        except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
            klog.event("jobenv_unwritten", logging.WARNING, ws=ws.key, problem=f"{type(e).__name__}: {e}")

    # --- dispatch -------------------------------------------------------------------------------------

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        key, seq = order.workspace.key, order.sleep.seq
        sleep = await self.worker.call(self.store.sleep, key, seq)
        assert sleep is not None
        if sleep_can(sleep.state, SleepEvent.SNAPSHOT):
            crash_point("recorded")
            try:
                await self.evaluation.precheck(order)
                snap = await self.heavy.run(
                    key,
                    functools.partial(
                        snapshot_sync,
                        tmp_dir=self.tmp_dir,
                        max_total_bytes=self.cfg.snapshot.max_bytes,
                        max_files=self.cfg.snapshot.max_files,
                        max_depth=self.cfg.snapshot.max_depth,
                        jail=self.listing_jail,
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
            await self.worker.call(self._record_snapshot, key, seq, snap)
            klog.event("snapshotted", ws=key, seq=seq, commit=snap.commit[:12], files=snap.files)
            crash_point("snapshot")
            sleep = await self.worker.call(self.store.sleep, key, seq)
            assert sleep is not None
        if sleep_can(sleep.state, SleepEvent.SUBMIT):
            row = await self.worker.call(self.store.exec_sleep, key, seq)
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
            await self.evaluation.prepare(order, row.commit, row.tree)
            jobs = await self.worker.call(self.store.jobs_of, key, seq)
            pending = [j for j in jobs if j.state == "PENDING"]
            specs = self.evaluation.specs(order, self.specs_of(order, row.commit, row.tree, pending, jobs))
            specs = await self._with_environments(order, row.tree, specs)
            account = await self.worker.call(self.store.slurm_account, key)
            if account is not None:
                specs = {n: msgspec.structs.replace(s, account=account) for n, s in specs.items()}
            ids: dict[tuple[str, int], str] = {}
            try:
                # Every run directory first, then every submit back to back: the launches start together.
                await self.heavy.run(key, _write_launches, list(specs.values()))
            except OSError as e:
                raise ExecutorUnavailable(f"writing the run directories of {key}/{seq}: {e}") from e
            done: list[JobSpec] = []
            for spec in specs.values():
                try:
                    refs = await self.backend.submit(spec)
                except BackendRefused as e:  # the agent's: answered, never retried
                    await self._refuse_partial(done, spec, e)
                except BackendUnavailable as e:  # the world's: tried again later
                    raise ExecutorUnavailable(f"submitting {spec.key}: {e}") from e
                done.append(spec)
                for r in refs:
                    ids[(spec.launch, r.task)] = r.job_id
            crash_point("submit")
            stray = await self.worker.call(self._record_submitted, key, seq, specs, ids)
            for launch, tasks in stray.items():  # cancelled while they were being submitted
                try:
                    await self.backend.cancel(f"{key}/{seq}/{launch}", tasks)
                except BackendUnavailable as e:
                    raise ExecutorUnavailable(f"cancelling {key}/{seq}/{launch}: {e}") from e
                klog.event("cancel_sent", ws=key, seq=seq, launch=launch, tasks=len(tasks))
            klog.event(
                "submitted",
                ws=key,
                seq=seq,
                launches=len(specs),
                tasks=len(ids),
                jobs=",".join(sorted({i for i in ids.values() if i}, key=job_order)),
            )
        jobs = await self.worker.call(self.store.jobs_of, key, seq)
        return tuple(JobRef(launch=j.launch, task=j.task, job_id=j.job_id) for j in jobs)

    async def _refuse_partial(self, done: list[JobSpec], spec: JobSpec, e: BackendRefused) -> NoReturn:
        """The backend refused `spec` for good: cancel the launches already submitted (never half a sleep), then
        reject the sleep with `backend.refused` (the pipeline refunds it)."""
        for other in done:
            await self.backend.cancel(other.key)
        klog.event("dispatch_refused", logging.WARNING, launch=spec.key, cancelled=len(done), error=str(e))
        raise DispatchRefused(
            RequestError(
                "backend.refused",
                f"the scheduler refused launch {spec.launch!r}: {e.detail}; nothing of this sleep runs "
                "and its charge is refunded",
                None,
            )
        ) from None

    # --- cancel ---------------------------------------------------------------------------------------

    async def cancel(self, order: SleepOrder, launches: tuple[str, ...]) -> None:
        await self.cancel_submitted(order.workspace.key, order.sleep.seq, launches)

    async def cancel_submitted(self, key: str, seq: int, launches: tuple[str, ...]) -> None:
        """Ask the backend to stop the live submitted tasks of the sleep's named launches (all if empty)."""
        jobs = await self.worker.call(self.store.jobs_of, key, seq)
        wanted = set(launches) or {j.launch for j in jobs}
        tasks: dict[str, list[int]] = {}
        for j in jobs:
            if j.launch in wanted and j.job_id is not None and j.state in LIVE_TASK_STATES:
                tasks.setdefault(j.launch, []).append(j.task)
        for launch, ts in tasks.items():
            try:
                stopped = await self.backend.cancel(f"{key}/{seq}/{launch}", ts)
            except BackendUnavailable as e:  # the world's: the cancel is tried again later
                raise ExecutorUnavailable(f"cancelling {key}/{seq}/{launch}: {e}") from e
            klog.event("cancel_sent", ws=key, seq=seq, launch=launch, tasks=len(stopped))


def _task_params(
    grid: dict[int, tuple[tuple[str, str], ...]], array: int
) -> tuple[tuple[tuple[str, str], ...], ...]:
    """A swept launch's values in task order (every task has its own row), or () for a launch without a sweep."""
    if not grid:
        return ()
    if sorted(grid) != list(range(array)):
        raise AssertionError(f"a swept launch's rows cover tasks {sorted(grid)}, not 0..{array - 1}")
    return tuple(grid[i] for i in range(array))
