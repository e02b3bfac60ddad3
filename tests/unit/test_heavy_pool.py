"""kernel.service.heavy: bounded slots, one job at a time per workspace, and the store worker stays free."""

from __future__ import annotations

import logging
import time

import anyio
import pytest
from _pools import Hang, assert_one_at_a_time_per_workspace_bounded_and_fair

from kernel.service.heavy import HeavyPool


def test_one_at_a_time_per_workspace_bounded_overall_and_fair() -> None:
    assert_one_at_a_time_per_workspace_bounded_and_fair(HeavyPool(60.0, size=2), "heavy jobs")


def test_a_hung_heavy_job_does_not_hold_other_workspaces() -> None:
    pool = HeavyPool(60.0, size=2)
    stuck = Hang()
    done: list[str] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, "stuck", stuck)
            await anyio.sleep(0.01)
            with anyio.fail_after(10):
                await pool.run("other", done.append, "other")
            stuck.release()

    anyio.run(main)
    assert done == ["other"]


def test_a_hung_job_past_the_deadline_gives_its_slot_back_and_only_its_workspace_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 13: four workspaces whose trees sit on a hung filesystem held all four slots forever, so nobody's
    snapshots or wakes ran. Past the deadline a hung job gives its slot back; its workspace still waits."""
    caplog.set_level(logging.INFO)
    pool = HeavyPool(0.2, size=4)
    hangs = {k: Hang() for k in ("a", "c", "d", "e")}
    ran: list[str] = []
    a_done = anyio.Event()

    async def a_later() -> None:
        await pool.run("a", ran.append, "a later")
        a_done.set()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for k, hung in hangs.items():
                tg.start_soon(pool.run, k, hung)
            await anyio.sleep(0.01)
            tg.start_soon(a_later)  # waits for a's hung job
            with anyio.fail_after(5):
                await pool.run("b", ran.append, "b")
            for i in range(6):  # every slot is free for the others, again and again
                with anyio.fail_after(5):
                    await pool.run("b", ran.append, f"b{i}")
            assert "a later" not in ran, "a second heavy job started while the workspace's first was out"
            # The four hung jobs started moments apart, each overdue 0.2 s after its own start: b's quick jobs
            # may all run (in the first freed slot) before the last of them is due.
            with anyio.fail_after(5):
                while set(pool.overdue) != {"a", "c", "d", "e"}:  # noqa: ASYNC110 - the pool has no event for it
                    await anyio.sleep(0.01)
            why = pool.degraded()
            assert why is not None
            assert "a since" in why
            assert "hung filesystem" in why
            assert caplog.text.count("event=heavy_overdue ws=a ") == 1
            hangs["a"].release()
            with anyio.fail_after(5):
                await a_done.wait()
            assert "a" not in pool.overdue
            assert caplog.text.count("event=heavy_returned ws=a") == 1
            for k in ("c", "d", "e"):
                hangs[k].release()
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
