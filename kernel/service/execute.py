"""The real executor: snapshot, submit, track, gather and wake, crash-safe at every step.

A sleep's life here (the pipeline has already recorded it `validated` with PENDING tasks and charged it), each
step in a component of its own, composed by `RealExecutor`:

1. dispatch (kernel.service.dispatch): snapshot the workspace into the kernel's own repository of it, record it,
   write each launch's run directory and hand it to the backend; record every task's job id.
2. tracking (kernel.service.tracking): `backend.wait_any_exit` reports each task's end at once; a tick re-reads
   the exit files of every live task (the ground truth) and marks started tasks RUNNING. Each recorded change
   rewrites the sleep's `results/<seq>/progress.json` (kernel.service.progress), first written before the answer.
3. gathering and waking (kernel.service.waking), when the sleep's last task has ended: artifacts delivered, ONE
   transaction for the refunds, the verdict and the wake's exact bytes (sleep `gathered`); then the wake files
   and `budget.json`, the sleep `woken`, the snapshot ref released. A sleep whose `wake_on` is met while tasks
   still run wakes early (`early_gathered`, `early_woken`) and its rest is gathered and woken later, or (`rest`
   "cancel") has its rest cancelled and wakes once they have stopped.
4. recovery at start: `backend.recover(run_dir)` adopts what still runs; recorded ends, complete sleeps and
   gathered-but-unwritten wakes are finished from the store and the run directories. No task is submitted
   twice (the backend looks before it acts) and no wake is written with different content.
Repository gc and retention (kernel.service.upkeep) run beside them.

What a submit adds (its plan, evaluation runs, verdict, hook, base upgrade) is the `Evaluation` strategy the
executor is given (kernel.service.evaluation; kernel.service.submitexec's `SubmitEvaluation`); plain sleeps use
`PlainSleeps`. After every gathering attempt and every tick the strategy may `settle` (the operator's hook).

`SYSCALL_KERNEL_CRASH_AT=<step>` (TEST ONLY, kernel.io.crash) makes the kernel SIGKILL itself at a step, for the
fault tests.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Final

import anyio
import anyio.to_thread

from channel.decode import RequestError, parse_request
from channel.messages import EnvironmentBuild, JobRef, SleepRequest
from kernel.backends.base import RunnableBackend, TaskExit
from kernel.core import rules
from kernel.core.config import Config, LiveConfig
from kernel.io import log as klog
from kernel.io.store import StoreUnavailable, StoreWorker
from kernel.service.building import STATUS_LINES, Builds, EnvironmentsCold, Sleep
from kernel.service.dispatch import Dispatcher
from kernel.service.evaluation import Evaluation, PlainSleeps
from kernel.service.executor import DispatchRefused, ExecutorUnavailable, SleepOrder
from kernel.service.heavy import HeavyPool
from kernel.service.progress import Progress
from kernel.service.tracking import Tracker
from kernel.service.upkeep import Upkeep
from kernel.service.waking import Waker

TICK_S: Final = 1.0
# A sleep accepted while its environment was built whose dispatch then failed for the world's reasons (the
# scheduler down) is dispatched again after REDO_BASE_S, doubling up to REDO_CAP_S.
REDO_BASE_S: Final = 1.0
REDO_CAP_S: Final = 300.0


class RealExecutor:
    """The `Executor` (kernel.service.executor) that runs sleeps on a backend: dispatch, tracking, waking and
    upkeep composed, with `evaluation` asked at each step of a sleep."""

    def __init__(
        self,
        live: LiveConfig,
        worker: StoreWorker,
        backend: RunnableBackend,
        *,
        evaluation: Evaluation | None = None,
        heavy: HeavyPool | None = None,
    ) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.backend = backend
        # Snapshots, artifact copies and wake writes: never on the store worker (see kernel.service.heavy).
        self.heavy = heavy if heavy is not None else HeavyPool(lambda: live.current.heavy_io_deadline_seconds)
        self.evaluation: Evaluation = evaluation if evaluation is not None else PlainSleeps()
        self.dispatcher = Dispatcher(live, worker, backend, self.heavy, self.evaluation)
        self.tracker = Tracker(worker, backend)
        self.waker = Waker(
            live,
            worker,
            backend,
            self.heavy,
            self.evaluation,
            refresh=self.tracker.sweep,
            cancel_rest=lambda key, seq: self.dispatcher.cancel_submitted(key, seq, ()),
        )
        self.upkeep = Upkeep(live, worker, self.heavy)
        self.progress = Progress(worker, self.heavy)
        # Sleeps of unenrolled workspaces whose cancel this process sent (`_withdraw`).
        self._withdrawn: set[tuple[str, int]] = set()
        self._withdraw_deferred: set[tuple[str, int]] = set()
        # Environments built in the background (kernel.service.building), and what the answers say of them.
        envs = self.dispatcher.envs
        self.builds = (
            None
            if envs is None
            else Builds(
                envs,
                lambda: self.cfg.environment.max_builds,
                on_ready=self._resume,
                on_failed=self._build_failed,
                on_started=self._build_started,
            )
        )
        self._accepted_building: dict[Sleep, EnvironmentBuild] = {}
        self._dispatching: dict[Sleep, anyio.Lock] = {}
        # Accepted sleeps to dispatch again (their dispatch failed for the world's reasons): (failures, when).
        self._redo: dict[Sleep, tuple[int, float]] = {}

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    def degraded(self) -> str | None:
        found = [why for why in (self.heavy.degraded(), self.backend.degraded()) if why]
        return "; ".join(found) or None

    def _setup(self) -> None:
        paths = self.cfg.paths
        paths.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
        paths.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    # --- the Executor protocol ------------------------------------------------------------------------

    async def recover(self) -> None:
        await anyio.to_thread.run_sync(self._setup)  # the kernel's own directories: no store step
        found = await self.backend.recover(self.cfg.paths.run_dir)
        klog.event(
            "backend_recovered",
            backend=self.backend.name,
            running=len(found.running),
            finished=len(found.finished),
            requeued=len(found.requeued),
            lost=len(found.lost),
        )
        await self._tick()
        # Sleeps answered before their environment was built, not submitted yet (the build was cut short by a
        # crash, or had not begun): dispatched again, which builds what is still cold in the background.
        for sleep in await self.worker.call(self._accepted_unsubmitted):
            await self._resume(sleep)

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        return await self._dispatch(order, answering=True)

    async def _dispatch(self, order: SleepOrder, *, answering: bool) -> tuple[JobRef, ...]:
        """Dispatch the sleep (the pipeline's, `answering` it; or a background one of an answered sleep), one
        dispatch of a sleep at a time."""
        key, seq = order.workspace.key, order.sleep.seq
        lock = self._dispatching.setdefault((key, seq), anyio.Lock())
        try:
            async with lock:
                return await self._dispatch_locked(order, answering)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._dispatching.pop((key, seq), None)

    async def _dispatch_locked(self, order: SleepOrder, answering: bool) -> tuple[JobRef, ...]:
        key, seq = order.workspace.key, order.sleep.seq
        try:
            if self.builds is not None and self.builds.waiting((key, seq)):
                return await self._building(order, answering)
            try:
                refs = await self.dispatcher.dispatch(order)
            except EnvironmentsCold as cold:
                assert self.builds is not None
                self.builds.want((key, seq), cold.needed)
                return await self._building(order, answering)
            if self.builds is not None:
                # the build it waited for is shown `ready` from here until it wakes (its tasks have job ids)
                self.progress.environment(key, seq, self.builds.view((key, seq)))
                self.builds.forget((key, seq))
            # Tasks that ended while the kernel was down (or before their ids were recorded), and a checkpoint.
            await self.tracker.sweep([(key, seq)])
            # Before the answer: a client that reads `accepted` finds the file if it could be written.
            await self.progress.publish(key, seq)
            await self._gather(key, seq)
            return refs
        finally:
            self.evaluation.forget(order)

    async def _building(self, order: SleepOrder, answering: bool) -> tuple[JobRef, ...]:
        """The refs of a sleep waiting for its environment (no job ids yet); its answer says `building`."""
        key, seq = order.workspace.key, order.sleep.seq
        assert self.builds is not None
        view = self.builds.view((key, seq))
        if view is not None and answering:
            self._accepted_building[(key, seq)] = view
        self.progress.environment(key, seq, view)
        await self.progress.publish(key, seq)
        jobs = await self.worker.call(self.store.jobs_of, key, seq)
        return tuple(JobRef(launch=j.launch, task=j.task, job_id=j.job_id) for j in jobs)

    def accepted_building(self, key: str, seq: int) -> EnvironmentBuild | None:
        """(the answer's store step) The build the sleep's `accepted` answer names, once."""
        return self._accepted_building.pop((key, seq), None)

    def environment_of(self, key: str, seq: int) -> EnvironmentBuild | None:
        """(a status's store step: memory only) The build the sleep waits for, with its log's last lines."""
        return None if self.builds is None else self.builds.view((key, seq), lines=STATUS_LINES)

    def environment_log(self, key: str, seq: int, lines: int) -> tuple[str, int, bool] | None:
        """(a tail's store step: memory only) The last `lines` lines the sleep's build printed, while it runs."""
        return None if self.builds is None else self.builds.log_tail((key, seq), lines)

    # --- sleeps accepted before their environment was built ---------------------------------------------

    def _accepted_unsubmitted(self) -> list[Sleep]:
        """(store worker) Sleeps answered `accepted` and not yet submitted: they waited for an environment."""
        out = []
        for s in self.store.live_sleeps():
            if s.state == "snapshotted":
                req = self.store.request(s.workspace, s.id)
                if req is not None and req.answer is not None:
                    out.append((s.workspace, s.seq))
        return out

    def _order_of(self, key: str, seq: int) -> SleepOrder | None:
        """(store worker) The order of an accepted sleep still to submit; None once it is submitted or over."""
        sleep = self.store.sleep(key, seq)
        ws = self.store.workspace(key)
        if sleep is None or ws is None or sleep.state != "snapshotted":
            return None
        row = self.store.request(key, sleep.id)
        if row is None or row.body is None or row.answer is None:
            return None  # not answered yet: the pipeline's continuation dispatches it
        req = parse_request(row.body, sleep.id)
        assert isinstance(req, SleepRequest)
        return SleepOrder(workspace=ws, sleep=sleep, request=req, jobs=tuple(self.store.jobs_of(key, seq)))

    async def _resume(self, sleep: Sleep) -> None:
        """Dispatch an accepted sleep again (its environments ready, or at start): its tasks are submitted, or it
        waits for another build; refused now, it wakes with the refusal's error, refunded."""
        key, seq = sleep
        self._redo.pop(sleep, None)
        try:
            order = await self.worker.call(self._order_of, key, seq)
            if order is None:
                if self.builds is not None:
                    self.builds.forget(sleep)
                return
            try:
                await self._dispatch(order, answering=False)
            except DispatchRefused as refusal:
                await self._wake_refused(sleep, refusal.error)
        except (ExecutorUnavailable, StoreUnavailable) as e:
            failures = self._redo.get(sleep, (0, 0.0))[0] + 1
            delay = rules.retry_delay(failures, REDO_BASE_S, REDO_CAP_S)
            self._redo[sleep] = (failures, anyio.current_time() + delay)
            klog.event("dispatch_deferred", logging.WARNING, ws=key, seq=seq, error=str(e), retry_in_s=delay)

    def _build_started(self, sleep: Sleep) -> None:
        """(event loop) The build the sleep waits for has begun: its progress file shows when."""
        if self.builds is not None:
            self.progress.environment(*sleep, self.builds.view(sleep))

    async def _build_failed(self, sleep: Sleep, error: str) -> None:
        if self.builds is not None:  # shown `failed` before the wake, which is the sleep's last word
            self.progress.environment(*sleep, self.builds.view(sleep))
            await self.progress.publish(*sleep)
        await self._wake_refused(
            sleep,
            RequestError(
                "environment.failed",
                f"the workspace's uv.lock could not be installed, so none of this sleep's tasks ran and its whole "
                f"charge is refunded: {error}",
                None,
            ),
        )

    async def _wake_refused(self, sleep: Sleep, error: RequestError) -> None:
        key, seq = sleep
        if self.builds is not None:
            self.builds.forget(sleep)
        await self.waker.wake_unrun(key, seq, error)
        self.progress.changed(key, seq)

    async def _redo_due(self) -> None:
        now = anyio.current_time()
        for sleep, (_, at) in list(self._redo.items()):
            if at <= now:
                await self._resume(sleep)

    async def cancel(self, order: SleepOrder, launches: tuple[str, ...]) -> None:
        await self.dispatcher.cancel(order, launches)
        self.progress.changed(order.workspace.key, order.sleep.seq)
        # Work that ends from here on is gathered as usual; a sleep whose tasks had all ended wakes now.
        await self._gather(order.workspace.key, order.sleep.seq)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.evaluation.run)
            await tg.start(self.backend.run)
            tg.start_soon(self._exit_loop)
            tg.start_soon(self.upkeep.run)
            tg.start_soon(self.progress.run)
            if self.builds is not None:
                tg.start_soon(self.builds.run)
            while True:
                await anyio.sleep(TICK_S)
                # A store that cannot be written (logged by the worker) only delays the tick's work.
                with contextlib.suppress(StoreUnavailable):
                    await self._withdraw()
                    await self._tick()
                    await self._redo_due()

    async def prune_once(self) -> int:
        """One retention pass now (kernel.service.upkeep); the number of sleeps pruned."""
        return await self.upkeep.prune_once()

    # --- composition ----------------------------------------------------------------------------------

    async def _gather(self, key: str, seq: int) -> None:
        if await self.waker.maybe_gather(key, seq):
            self.progress.changed(
                key, seq
            )  # the sleep's state (an early wake's, say) is in its progress file
        await self.evaluation.settle()

    async def _tick(self) -> None:
        sleeps, changed = await self.tracker.sweep_all()
        for key, seq in changed:
            self.progress.changed(key, seq)
        for key, seq in sleeps:
            await self._gather(key, seq)
        for key, seq in await self.worker.call(self.waker.unreleased):
            await self.waker.release(key, seq)
        await self.evaluation.settle()

    async def _withdraw(self) -> None:
        """The sleeps in flight of workspaces the operator unenrolled (`unenroll --force`): their jobs are cancelled
        (once per kernel process; at the next tick again while the backend cannot act), and their ends gathered as
        any others, with nothing written into the channel that is gone (kernel.service.waking)."""
        for key, seq in await self.worker.call(self.waker.withdrawn):
            if (key, seq) in self._withdrawn:
                continue
            try:
                await self.dispatcher.cancel_submitted(key, seq, ())
            except ExecutorUnavailable as e:
                if (key, seq) not in self._withdraw_deferred:  # logged once; tried again at every tick
                    self._withdraw_deferred.add((key, seq))
                    klog.event("unenrolled_cancel_deferred", logging.WARNING, ws=key, seq=seq, problem=str(e))
                continue
            self._withdrawn.add((key, seq))
            klog.event("unenrolled_sleep_cancelled", ws=key, seq=seq)
            await self._gather(key, seq)

    async def _on_exit(self, ex: TaskExit) -> None:
        ended = await self.tracker.on_exit(ex)
        if ended is not None:
            key, seq, recorded = ended
            if recorded:
                self.progress.changed(key, seq)
            await self._gather(key, seq)

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
