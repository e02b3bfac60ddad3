"""The kernel-written files of served channels, refreshed off the store worker: `Refresher`.

At start, the admission checks each channel and watches it, and nothing more (a restart with 10,000 workspaces is
ready in 2 s); the channels it admitted are stale (kernel.core.serving). After `ready`, `refresh_served` rewrites
their kernel-written files where stale (the tool, kernel.json, budget.json, jobenv.json) and sweeps an earlier
process's temps, each channel in its own turn in the pipeline's channel I/O pool. A look at a channel not served
yet rewrites them too, while it has the channel open (`rewrite_kernel_files`).

Invariants, and why they hold:
- Never on the store worker, and a hung channel holds only its own workspace: each refresh is a call in the
  channel I/O pool (`Pipeline.chanio`), whose deadline marks it overdue; at most REFRESH_CALLS are in the pool at
  once, so a request's turn waits behind at most that many of them for a slot.
- budget.json never replaces a newer balance: the row is read, with its stamp, under the store worker's lock at
  the start of the very call that writes it (`row_stamped`, `run_here`), and written in the order of such reads
  (kernel.io.budgetorder).
- Nothing is written to a channel another store took over since its admission (the owner is checked first:
  `on_taken_over`), and no temp younger than this process is swept (it may be a write in flight).
- Owns this process's start time (which channels are stale is kernel.core.serving's); the pipeline, the store
  worker and the channel problems are the service's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable

import anyio

from channel import safefs
from channel.messages import StoreRef
from channel.paths import ChannelPaths
from kernel.core.config import Config, LiveConfig
from kernel.core.records import WorkspaceRow
from kernel.io import crash, log
from kernel.io import enroll as enrollment
from kernel.io.install import ToolSource
from kernel.io.store import StoreWorker
from kernel.service.chanio import ChannelIOAbandoned, store_step
from kernel.service.pipeline import Pipeline
from kernel.service.watching import CHANNEL_ERRORS

# After `ready`, stale channels are refreshed in the channel I/O pool, at most this many at a time (fewer than the
# pool's slots, so the request path always has slots).
REFRESH_CALLS = 2


class Refresher:
    """Rewrites the kernel-written files of the channels it is given (after `ready`: `refresh_served`) and of one
    open channel (`rewrite_kernel_files`). The service gives it the live config, the store worker, the
    pipeline (its served workspaces and channel I/O pool), the tool, `stopping`, `on_taken_over` (another store
    owns the channel now) and `on_problem` (the channel cannot be opened or read)."""

    def __init__(
        self,
        live: LiveConfig,
        worker: StoreWorker,
        pipeline: Pipeline,
        tool: ToolSource,
        *,
        stopping: Callable[[], bool],
        on_taken_over: Callable[[WorkspaceRow, enrollment.OwnedElsewhere], Awaitable[None]],
        on_problem: Callable[[WorkspaceRow, Exception], None],
    ) -> None:
        self.live = live
        self.worker = worker
        self.store = worker.store
        self.pipeline = pipeline
        self.tool = tool
        self.stopping = stopping
        self.on_taken_over = on_taken_over
        self.on_problem = on_problem
        # Temps older than this process are an earlier one's leftovers.
        self._started_ns = time.time_ns()

    @property
    def cfg(self) -> Config:
        """The running config, read at each use (kernel.core.config.LiveConfig)."""
        return self.live.current

    def _rewrite_stale(self, key: str, mine: str) -> str | None:
        """(channel I/O pool, in `key`'s turn) Rewrite an admitted channel's kernel-written files where stale and
        sweep temps older than this process; the tool note. The row is read, with its stamp, under the store
        worker's lock at the start of this very call (`run_here`), and budget.json is written in the order of
        such reads (kernel.io.budgetorder), so it never replaces a newer balance that the pipeline or a wake
        (heavy pool) wrote meanwhile."""
        with store_step():
            row, stamp = self.worker.run_here(self.row_stamped, key)
        if row is None:
            return None
        crash.hang_point("refresh", row.path)
        with safefs.open_channel(row.path, row.identity) as ch:
            # Another store may have taken the channel over since its admission: nothing is written then.
            owner = enrollment.check_owner(self.store, ch, row.path, mine=mine)
            return self.rewrite_kernel_files(ch, row, owner, stamp)

    def rewrite_kernel_files(
        self, ch: safefs.Channel, row: WorkspaceRow, owner: StoreRef, stamp: int
    ) -> str | None:
        """Rewrite the channel's kernel-written files where stale (budget.json in the order of `stamp`,
        kernel.io.budgetorder) and sweep the kernel temps older than this process; the tool note, if any."""
        note = enrollment.rewrite_kernel_files(
            ch,
            row,
            self.tool,
            owner,
            jail=self.cfg.jail,
            cfg=self.cfg,
            order=self.store.budget_order,
            stamp=stamp,
        )
        self._sweep_temps(ch)
        return note

    def _sweep_temps(self, ch: safefs.Channel) -> None:
        """Remove the kernel temps older than this process from the channel, its answers/ and its requests/ (a
        request moved aside for removal by a killed kernel); a younger one may be a write in flight, whose rename
        would fail if its temp were removed under it."""
        safefs.sweep_kernel_temps(ch.fd, self._started_ns)
        for sub in (ChannelPaths.ANSWERS, ChannelPaths.REQUESTS):
            dfd = ch.subdir(sub)
            try:
                safefs.sweep_kernel_temps(dfd, self._started_ns)
            finally:
                os.close(dfd)

    def row_stamped(self, key: str) -> tuple[WorkspaceRow | None, int]:
        """(a store step) The row, and the stamp of this read of its balance (kernel.io.budgetorder)."""
        return self.store.workspace(key), self.store.budget_order.stamp()

    async def refresh_one(self, key: str, mine: str) -> None:
        """Refresh `key`'s channel (`_rewrite_stale`) in its turn in the channel I/O pool, if it is still served."""
        row = self.pipeline.workspaces.get(key)
        if row is None or self.stopping():  # no longer served
            return
        try:
            note = await self.pipeline.chanio.run(key, self._rewrite_stale, key, mine)
        except enrollment.OwnedElsewhere as exc:
            await self.on_taken_over(row, exc)
            return
        except CHANNEL_ERRORS as exc:
            self.on_problem(row, exc)
            return
        except ChannelIOAbandoned:
            return
        if note is not None:
            log.event("tool_updated", ws=key, sha256=self.tool.sha256[:16])

    async def refresh_served(self, keys: tuple[str, ...]) -> None:
        """After `ready`: refresh the channels the admission left stale, or a reload's new policy made stale
        (`keys`: kernel.core.serving owns that list) (`_rewrite_stale`), in the channel I/O pool, never on
        the store worker: a channel that hangs there holds only its own workspace (the pool's deadline marks it
        overdue), and the store worker stays free for every other workspace's requests. At most REFRESH_CALLS
        refreshes are in the pool at once, so a request's turn waits behind at most that many of them for a
        slot."""
        mine = await self.worker.call(self.store.store_id) if keys else None
        if mine is None:
            log.event("channels_refreshed", workspaces=0)
            return
        pending = iter(keys)

        async def refresher() -> None:
            for key in pending:
                if self.stopping():
                    return
                await self.refresh_one(key, mine)

        async with anyio.create_task_group() as tg:
            for _ in range(REFRESH_CALLS):
                tg.start_soon(refresher)
        if not self.stopping():
            log.event("channels_refreshed", workspaces=len(keys))
