"""kernel.service.heavy: bounded slots, one job at a time per workspace, and the store worker stays free."""

from __future__ import annotations

import logging
import threading
import time

import anyio
import pytest

from kernel.service.heavy import HeavyPool


def test_one_at_a_time_per_workspace_bounded_overall_and_fair() -> None:
    pool = HeavyPool(60.0, size=2)
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
    pool = HeavyPool(60.0, size=2)
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


def test_a_hung_job_past_the_deadline_gives_its_slot_back_and_only_its_workspace_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 13: four workspaces whose trees sit on a hung filesystem held all four slots forever, so nobody's
    snapshots or wakes ran. Past the deadline a hung job gives its slot back; its workspace still waits."""
    caplog.set_level(logging.INFO)
    pool = HeavyPool(0.2, size=4)
    release = {k: threading.Event() for k in ("a", "c", "d", "e")}
    ran: list[str] = []
    a_done = anyio.Event()

    async def a_later() -> None:
        await pool.run("a", ran.append, "a later")
        a_done.set()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for k, hung in release.items():
                tg.start_soon(pool.run, k, hung.wait, 30.0)
            await anyio.sleep(0.01)
            tg.start_soon(a_later)  # waits for a's hung job
            with anyio.fail_after(5):
                await pool.run("b", ran.append, "b")
            for i in range(6):  # every slot is free for the others, again and again
                with anyio.fail_after(5):
                    await pool.run("b", ran.append, f"b{i}")
            assert "a later" not in ran, "a second heavy job started while the workspace's first was out"
            assert set(pool.overdue) == {"a", "c", "d", "e"}
            why = pool.degraded()
            assert why is not None
            assert "a since" in why
            assert "hung filesystem" in why
            assert caplog.text.count("event=heavy_overdue ws=a ") == 1
            release["a"].set()
            with anyio.fail_after(5):
                await a_done.wait()
            assert "a" not in pool.overdue
            assert caplog.text.count("event=heavy_returned ws=a") == 1
            for k in ("c", "d", "e"):
                release[k].set()
        assert pool.overdue == {}
        assert pool.degraded() is None
        assert pool.workspaces == 0

    anyio.run(main)
    assert caplog.text.count("event=heavy_overdue ws=a ") == 1, "logged once"


def test_a_started_job_finishes_when_its_caller_is_cancelled() -> None:
    """A started copy is not abandoned half-way: the cancelled caller waits for it (the slot and the workspace's
    turn are held until it returns)."""
    pool = HeavyPool(60.0, size=1)
    done: list[str] = []

    def slow() -> None:
        time.sleep(0.3)
        done.append("copied")

    async def main() -> None:
        with anyio.move_on_after(0.05):
            await pool.run("a", slow)
        assert done == ["copied"]

    anyio.run(main)
