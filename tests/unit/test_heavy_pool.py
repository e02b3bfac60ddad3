"""kernel.service.heavy: bounded slots, one job at a time per workspace, and the store worker stays free."""

from __future__ import annotations

import threading
import time

import anyio

from kernel.service.heavy import HeavyPool


def test_one_at_a_time_per_workspace_bounded_overall_and_fair() -> None:
    pool = HeavyPool(size=2)
    running: dict[str, int] = {}
    peak_total = 0
    order: list[str] = []
    lock = threading.Lock()

    def job(key: str) -> None:
        nonlocal peak_total
        with lock:
            running[key] = running.get(key, 0) + 1
            assert running[key] == 1, f"{key} ran two heavy jobs at once"
            peak_total = max(peak_total, sum(running.values()))
        time.sleep(0.05)
        with lock:
            running[key] -= 1
            order.append(key)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(6):  # a flooding workspace queues six jobs first
                tg.start_soon(pool.run, "flood", job, "flood")
            await anyio.sleep(0.01)
            for k in ("b", "c"):
                tg.start_soon(pool.run, k, job, k)

    anyio.run(main)
    assert peak_total <= 2
    assert order.count("flood") == 6
    # b and c queued behind at most one of flood's jobs each, never behind all six
    assert max(order.index("b"), order.index("c")) <= 3, order
    assert pool.workspaces == 0, "locks of idle workspaces are forgotten"


def test_a_hung_heavy_job_does_not_hold_other_workspaces() -> None:
    pool = HeavyPool(size=2)
    release = threading.Event()
    done: list[str] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, "stuck", release.wait, 30.0)
            await anyio.sleep(0.01)
            with anyio.fail_after(10):
                await pool.run("other", done.append, "other")
            release.set()

    anyio.run(main)
    assert done == ["other"]
