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
   and `budget.json`, the sleep `woken`, the snapshot ref released.
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

from channel.messages import JobRef
from kernel.backends.base import RunnableBackend, TaskExit
from kernel.core.config import Config, LiveConfig
from kernel.io import log as klog
from kernel.io.store import StoreUnavailable, StoreWorker
from kernel.service.dispatch import Dispatcher
from kernel.service.evaluation import Evaluation, PlainSleeps
from kernel.service.executor import ExecutorUnavailable, SleepOrder
from kernel.service.heavy import HeavyPool
from kernel.service.progress import Progress
from kernel.service.tracking import Tracker
from kernel.service.upkeep import Upkeep
from kernel.service.waking import Waker

TICK_S: Final = 1.0


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
        self.waker = Waker(live, worker, backend, self.heavy, self.evaluation)
        self.upkeep = Upkeep(live, worker, self.heavy)
        self.progress = Progress(worker, self.heavy)
        # Sleeps of unenrolled workspaces whose cancel this process sent (`_withdraw`).
        self._withdrawn: set[tuple[str, int]] = set()
        self._withdraw_deferred: set[tuple[str, int]] = set()

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

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        key, seq = order.workspace.key, order.sleep.seq
        try:
            refs = await self.dispatcher.dispatch(order)
            # Tasks that ended while the kernel was down (or before their ids were recorded), and a checkpoint.
            await self.tracker.sweep([(key, seq)])
            # Before the answer: a client that reads `accepted` finds the file if it could be written.
            await self.progress.publish(key, seq)
            await self._gather(key, seq)
            return refs
        finally:
            self.evaluation.forget(order)

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
            while True:
                await anyio.sleep(TICK_S)
                # A store that cannot be written (logged by the worker) only delays the tick's work.
                with contextlib.suppress(StoreUnavailable):
                    await self._withdraw()
                    await self._tick()

    async def prune_once(self) -> int:
        """One retention pass now (kernel.service.upkeep); the number of sleeps pruned."""
        return await self.upkeep.prune_once()

    # --- composition ----------------------------------------------------------------------------------

    async def _gather(self, key: str, seq: int) -> None:
        await self.waker.maybe_gather(key, seq)
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
