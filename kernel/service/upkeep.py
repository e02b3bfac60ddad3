"""Upkeep: the executor's slow background work, off the hot path: repository gc and retention.

Each workspace's kernel repository is packed and pruned every `repo_gc_hours`; retention removes the run
directories and results of old sleeps (`retention_days`, `retention_sleeps`, and past `retention_run_mb` of run
directories) and the records of read requests.
Both go through the heavy pool, one workspace at a time.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime, timedelta
from typing import Final

import anyio
import anyio.to_thread

from channel import safefs
from kernel.core import retention
from kernel.core.config import Config, LiveConfig
from kernel.io import log as klog
from kernel.io import retention as rfiles
from kernel.io.repo import KernelRepo, RepoError
from kernel.io.store import StoreUnavailable, StoreWorker, timestamp
from kernel.service.heavy import HeavyPool

GC_LOOK_S: Final = 60.0  # how often the kernel looks for a repository due for gc
RETENTION_LOOK_S: Final = 600.0  # how often retention looks for evidence to prune (and once at start)


class Upkeep:
    """Repository gc and retention, each a loop the executor starts in its task group."""

    def __init__(self, live: LiveConfig, worker: StoreWorker, heavy: HeavyPool) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.heavy = heavy
        self._measuring = anyio.CapacityLimiter(1)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.gc_loop)
            if self.cfg.retention_days > 0 or self.cfg.retention_sleeps > 0 or self.cfg.retention_run_mb > 0:
                tg.start_soon(self.retention_loop)

    async def gc_loop(self) -> None:
        """Each workspace's kernel repository is packed and pruned every `repo_gc_hours`, one at a time, off the
        hot path (held bases and unreleased snapshots are refs, so they stay)."""
        while True:
            await anyio.sleep(GC_LOOK_S)
            for ws in await self.worker.call(self.store.workspaces):
                repo = KernelRepo.at(self.cfg.run_dir, ws.key)
                if not repo.gc_due(self.cfg.repo_gc_hours * 3600):
                    continue
                try:
                    await self.heavy.run(ws.key, repo.gc)
                    klog.event("repo_gc", ws=ws.key)
                except (RepoError, OSError) as e:
                    klog.event("repo_gc_failed", logging.WARNING, ws=ws.key, problem=str(e)[:300])

    async def retention_loop(self) -> None:
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
        keep_bytes = self.cfg.retention_run_mb << 20
        by_rules = self.cfg.retention_days > 0 or self.cfg.retention_sleeps > 0
        for ws in await self.worker.call(self.store.workspaces):
            # The size cap measures on a thread of its own, one workspace at a time: never a heavy slot or the
            # store worker for a workspace under its cap (the common case, and every workspace at start).
            over = keep_bytes > 0 and (
                await anyio.to_thread.run_sync(
                    rfiles.run_bytes, self.cfg.run_dir, ws.key, limiter=self._measuring
                )
                > keep_bytes
            )
            if not (by_rules or over):
                continue
            ages = [
                retention.SleepAge(seq, state, _when(woken or made))
                for seq, state, made, woken in await self.worker.call(self.store.sleep_ages, ws.key)
            ]
            if over:
                ages = await anyio.to_thread.run_sync(
                    rfiles.with_run_bytes, self.cfg.run_dir, ws.key, ages, limiter=self._measuring
                )
            seqs = retention.to_prune(
                ages,
                keep_sleeps=self.cfg.retention_sleeps,
                keep_days=self.cfg.retention_days,
                now=now,
                keep_bytes=keep_bytes if over else 0,
            )
            for seq in seqs:
                try:
                    run_b = await self.heavy.run(ws.key, rfiles.remove_run_dir, self.cfg.run_dir, ws.key, seq)
                    res_b = await self.heavy.run(ws.key, rfiles.remove_results, ws, seq)
                except (safefs.ChannelMoved, safefs.Refused, OSError) as e:
                    klog.event("prune_failed", logging.WARNING, ws=ws.key, seq=seq, problem=str(e)[:300])
                    break  # this workspace waits for the next look; the others go on
                await self.worker.call(self._record_pruned, ws.key, seq, run_b, res_b)
                klog.event("pruned", ws=ws.key, seq=seq, run_bytes=run_b, result_bytes=res_b)
                pruned += 1
            if self.cfg.retention_days > 0:
                cutoff = timestamp((now - timedelta(days=self.cfg.retention_days)).timestamp())
                gone = await self.worker.call(self._prune_requests, ws.key, cutoff)
                if gone:
                    klog.event("requests_pruned", ws=ws.key, count=gone)
        return pruned

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    def _record_pruned(self, key: str, seq: int, run_bytes: int, result_bytes: int) -> None:
        with self.store.transaction():
            self.store.record_pruned(key, seq, timestamp(), run_bytes, result_bytes)
            # The stored wake bytes served only to (re)write the wake; a woken sleep's are on disk.
            self.store.drop_wake_bytes(key, seq)

    def _prune_requests(self, key: str, cutoff: str) -> int:
        with self.store.transaction():
            return self.store.prune_read_requests(key, cutoff)


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
