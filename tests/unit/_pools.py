"""What the pool tests build alike (test_channel_io_pool, test_heavy_pool): HeavyPool is the channel I/O pool's
mechanism with a longer deadline, so the same flood and the same hang test both (real threads)."""

from __future__ import annotations

import threading
import time

import anyio

from kernel.service.chanio import ChannelIO
from kernel.service.heavy import HeavyPool

# A hung call returns by itself after this long at the latest, so a failed test leaves no thread blocked for good.
HANG_S = 30.0


class Hang:
    """A call that blocks its thread the way I/O on a hung filesystem does, until the test calls `release()`."""

    def __init__(self) -> None:
        self._released = threading.Event()

    def __call__(self) -> bool:
        return self._released.wait(HANG_S)

    def release(self) -> None:
        self._released.set()


def assert_one_at_a_time_per_workspace_bounded_and_fair(pool: ChannelIO | HeavyPool, what: str) -> None:
    """`pool` has two slots. A flooding workspace queues six calls first, then b and c one each: no workspace ever
    runs two at once, at most two run in all, b and c each wait behind at most one of the flood's calls (never
    behind all six), and the locks of idle workspaces are forgotten. `what`: the pool's calls, for the message."""
    running: dict[str, int] = {}
    peak_total = 0
    order: list[str] = []
    lock = threading.Lock()

    def job(key: str) -> None:
        nonlocal peak_total
        with lock:
            running[key] = running.get(key, 0) + 1
            assert running[key] == 1, f"{key} ran two {what} at once"
            peak_total = max(peak_total, sum(running.values()))
        time.sleep(0.05)
        with lock:
            running[key] -= 1
            order.append(key)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(6):  # a flooding workspace queues six calls first
                tg.start_soon(pool.run, "flood", job, "flood")
            await anyio.sleep(0.01)
            for k in ("b", "c"):
                tg.start_soon(pool.run, k, job, k)

    anyio.run(main)
    assert peak_total <= 2
    assert order.count("flood") == 6
    # b and c queued behind at most one of the flood's calls each, never behind all six
    assert max(order.index("b"), order.index("c")) <= 3, order
    assert pool.workspaces == 0, "locks of idle workspaces are forgotten"
