"""The rescan's ledger as the service drives it (kernel.service.loop, kernel.core.polling.RescanLedger): in
process, with a real store, real enrollment and real directories. The service's clock is set far from the wall
clock's, so times of two clocks mixed up (the pipeline's listing times against the ledger's looks) confirm
nothing."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
from _parts import TOOL, ReadyNotifier, enrolled

from kernel.core.config import LiveConfig, parse
from kernel.io.store import Store
from kernel.service.loop import Service


def test_a_served_channel_is_confirmed_on_the_services_clock(tmp_path: Path) -> None:
    cfg = parse(
        f'state_dir = "{tmp_path}/state"\nwatch = "poll"\npoll_seconds = 0.1\nrescan_seconds = 0.5\n',
        "<t>",
        env={},
    )
    store = Store.open(cfg.paths.store)
    _, row = enrolled(tmp_path, store, cfg)
    notifier = ReadyNotifier()
    svc = Service(LiveConfig(cfg), store, notifier, TOOL, clock=lambda: time.monotonic() + 1e10)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            with anyio.fail_after(20):
                await notifier.is_ready.wait()
                while not svc.rescans.trusted(row.key):  # noqa: ASYNC110 - the ledger's state, not an event
                    await anyio.sleep(0.05)
            svc.stop("test")

    try:
        anyio.run(main)
    finally:
        store.close()
