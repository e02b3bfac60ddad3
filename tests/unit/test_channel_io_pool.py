"""kernel.service.chanio: one call per workspace at a time, bounded, fair, and a deadline that frees the slot of a
hung workspace (real threads; the hang is a threading.Event a test holds)."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from _pools import Hang, assert_one_at_a_time_per_workspace_bounded_and_fair

from kernel.service.chanio import ChannelIO, ChannelIOAbandoned


def test_one_call_at_a_time_per_workspace_bounded_overall_and_fair() -> None:
    assert_one_at_a_time_per_workspace_bounded_and_fair(ChannelIO(30.0, size=2), "channel calls")


def test_an_overdue_call_gives_its_slot_back_and_nothing_more_starts_for_its_workspace() -> None:
    hung = Hang()
    seen: list[tuple[str, str]] = []
    ran: list[str] = []

    async def overdue(key: str, since: float) -> None:
        seen.append(("overdue", key))

    async def returned(key: str) -> None:
        seen.append(("returned", key))

    pool = ChannelIO(0.2, size=1, on_overdue=overdue, on_returned=returned)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, "hung", hung)
            await anyio.sleep(0.01)
            tg.start_soon(pool.run, "hung", ran.append, "hung again")  # waits for the hung call
            # One slot only, held by the hung call until its deadline: then the other workspace gets it.
            with anyio.fail_after(5):
                await pool.run("other", ran.append, "other")
            assert seen == [("overdue", "hung")]
            assert "hung" in pool.overdue
            for i in range(5):
                with anyio.fail_after(5):
                    await pool.run(f"w{i}", ran.append, f"w{i}")
            assert "hung again" not in ran, "a second call started while the workspace's I/O was out"
            hung.release()
        assert seen == [("overdue", "hung"), ("returned", "hung")]
        assert ran[-1] == "hung again"
        assert pool.overdue == {}

    anyio.run(main)


def test_errors_come_back_to_the_caller() -> None:
    pool = ChannelIO(5.0)

    def boom() -> None:
        raise OSError(5, "Input/output error")

    async def main() -> None:
        with pytest.raises(OSError, match="Input/output error"):
            await pool.run("a", boom)
        assert await pool.run("a", lambda: 7) == 7

    anyio.run(main)


def test_a_stop_abandons_an_overdue_call_and_what_waits_behind_it() -> None:
    hung = Hang()
    pool = ChannelIO(0.1, size=2)
    outcomes: list[str] = []

    async def call(what: str) -> None:
        try:
            await pool.run("hung", hung)
            outcomes.append(f"{what}: returned")
        except ChannelIOAbandoned:
            outcomes.append(f"{what}: abandoned")

    async def main() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "first")
                await anyio.sleep(0.01)
                tg.start_soon(call, "second")
                await anyio.sleep(0.3)  # past the deadline
                pool.stop()
            assert await pool.run("other", lambda: "served") == "served"

    anyio.run(main)
    hung.release()
    assert sorted(outcomes) == ["first: abandoned", "second: abandoned"]


def test_time_in_a_store_step_is_not_channel_io() -> None:
    """A turn that waits for the store (held by another step) past the deadline is not a hung channel; channel
    I/O after the store step is timed afresh."""
    from kernel.service.chanio import store_step

    seen: list[str] = []

    async def overdue(key: str, since: float) -> None:
        seen.append(key)

    pool = ChannelIO(0.2, on_overdue=overdue)
    store = threading.Lock()

    def turn() -> str:
        time.sleep(0.1)  # channel I/O, within the deadline
        with store_step(), store:
            pass
        time.sleep(0.1)  # and again, timed from the end of the store step
        return "done"

    async def main() -> None:
        store.acquire()
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, "a", turn)
            await anyio.sleep(0.6)  # the turn waits for the store three deadlines long
            store.release()
        assert seen == []
        hung = threading.Event()

        def hangs() -> None:
            with store_step():
                pass
            hung.wait(0.5)  # channel I/O past the deadline after the store step: overdue

        await pool.run("b", hangs)
        assert seen == ["b"]

    anyio.run(main)


def test_a_call_through_several_channels_is_timed_per_channel() -> None:
    """The start-up admission works through many channels in one call: each is timed afresh (`timed_afresh`), so
    a call longer than the deadline in all is not overdue while each channel answers within it; one channel past
    it is, and the overdue report's `since` is when that channel's I/O began."""
    from kernel.service.chanio import timed_afresh

    seen: list[tuple[str, float]] = []

    async def overdue(key: str, since: float) -> None:
        seen.append((key, since))

    pool = ChannelIO(0.2, on_overdue=overdue)
    began: list[float] = []

    def channels(delays: list[float]) -> int:
        for delay in delays:
            timed_afresh()
            began.append(time.time())
            time.sleep(delay)
        return len(delays)

    async def main() -> None:
        assert await pool.run("calls", channels, [0.1] * 6) == 6  # 0.6 s in all, 0.1 s per channel
        assert seen == []
        began.clear()
        assert await pool.run("calls", channels, [0.05, 0.05, 0.5]) == 3
        assert [k for k, _ in seen] == ["calls"]
        assert abs(seen[0][1] - began[2]) < 0.05, "since: when the slow channel's I/O began"

    anyio.run(main)


def test_begin_starts_the_call_before_the_loop_runs_anything_else_and_finish_returns_it() -> None:
    """`begin` (from the event loop, no await) has the call on a pool thread when it returns: the thread runs
    while the loop is still blocked in this test's code; `finish` gives what it returned."""
    pool = ChannelIO(5.0, size=2)
    ran = threading.Event()
    waiters: list[object] = []

    async def main() -> None:
        started = pool.begin("a", lambda: ran.set() or "done", waiter=waiters.append)
        assert started
        assert len(waiters) == 1
        assert ran.wait(5), "the call did not start until the loop ran again"
        assert pool.running("a")
        assert await pool.finish(waiters[0]) == "done"  # type: ignore[arg-type]
        assert not pool.running("a")
        assert pool.workspaces == 0

    anyio.run(main)


def test_begin_passes_no_one_a_busy_workspace_or_a_full_pool_is_left_to_run() -> None:
    hung = Hang()
    pool = ChannelIO(30.0, size=1)
    waiters: list[object] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, "a", hung)
            await anyio.sleep(0.05)
            assert not pool.can_begin("a")
            assert not pool.begin("a", print, waiter=waiters.append)
            # The only slot is a's: b may not take one, nor pass a caller waiting for it.
            assert not pool.can_begin("b")
            assert not pool.begin("b", print, waiter=waiters.append)
            assert waiters == []
            assert not pool.running("b")
            hung.release()
        assert pool.begin("b", lambda: "b", waiter=waiters.append)
        assert await pool.finish(waiters[0]) == "b"  # type: ignore[arg-type]
        pool.stop()
        assert not pool.can_begin("c"), "nothing new starts once the pool is stopping"

    anyio.run(main)


def test_a_waiter_that_fails_gives_the_turn_and_the_slot_back_and_nothing_runs() -> None:
    pool = ChannelIO(5.0, size=1)
    ran: list[str] = []

    def broken(started: object) -> None:
        raise RuntimeError("no task group")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="no task group"):
            pool.begin("a", ran.append, "a", waiter=broken)
        assert not pool.running("a")
        assert pool.can_begin("a")
        assert await pool.run("a", ran.append, "again") is None
        assert ran == ["again"]

    anyio.run(main)


def test_a_call_begun_then_overdue_frees_its_slot_and_its_workspace_waits() -> None:
    """`finish` keeps `run`'s rules: past the deadline the slot goes back and the workspace's next call waits
    for the hung one."""
    hung = Hang()
    seen: list[str] = []

    async def overdue(key: str, since: float) -> None:
        seen.append(key)

    pool = ChannelIO(0.2, size=1, on_overdue=overdue)
    waiters: list[object] = []
    ran: list[str] = []

    async def main() -> None:
        assert pool.begin("a", hung, waiter=waiters.append)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.finish, waiters[0])
            tg.start_soon(pool.run, "a", ran.append, "a again")
            with anyio.fail_after(5):
                await pool.run("b", ran.append, "b")
            assert seen == ["a"]
            assert ran == ["b"]
            hung.release()
        assert ran == ["b", "a again"]

    anyio.run(main)
