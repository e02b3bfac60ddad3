"""The one-thread inotify watcher on real directories: keys handed to the loop once, overflow, lost watches,
and watches pinned to the inode that was opened."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread

from kernel.io.watch import Watcher


async def until(cond: Callable[[], bool], what: str, deadline_s: float = 5.0) -> None:
    with anyio.fail_after(deadline_s):
        while not cond():  # noqa: ASYNC110 - the condition is set by another thread
            await anyio.sleep(0.005)


def commit(d: Path, name: str) -> None:
    (d / f".{name}.tmp").write_text("{}")
    os.rename(d / f".{name}.tmp", d / f"{name}.json")


def with_watcher(
    size: int, body: Callable[[Watcher, anyio.abc.ObjectReceiveStream[str]], Awaitable[None]]
) -> None:
    async def main() -> None:
        send, recv = anyio.create_memory_object_stream[str](size)
        w = Watcher(send.send_nowait)
        w.start()
        try:
            await body(w, recv)
        finally:
            w.stop()
            send.close()
            recv.close()
            await anyio.to_thread.run_sync(w.join, 5.0)
        assert not w.healthy()

    anyio.run(main)


def add(w: Watcher, key: str, d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        w.add(key, fd)
    finally:
        os.close(fd)


def test_a_flood_in_one_channel_queues_its_key_once(tmp_path: Path) -> None:
    d = tmp_path / "a"
    d.mkdir()

    async def body(w: Watcher, recv: anyio.abc.ObjectReceiveStream[str]) -> None:
        assert w.healthy()
        add(w, "a", d)
        for i in range(200):
            commit(d, f"r{i}")
        with anyio.fail_after(5):
            assert await recv.receive() == "a"
        # Everything after the first event coalesced into that one queued key; temp files raise nothing.
        await anyio.to_thread.run_sync(commit, d, "after-a-while")
        w.consumed("a")
        commit(d, "next")
        with anyio.fail_after(5):
            assert await recv.receive() == "a"

    with_watcher(16, body)


def test_a_full_stream_asks_for_a_rescan(tmp_path: Path) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(4)]

    async def body(w: Watcher, recv: anyio.abc.ObjectReceiveStream[str]) -> None:
        for i, d in enumerate(dirs):
            d.mkdir()
            add(w, f"k{i}", d)
        for d in dirs:
            commit(d, "x")
        await until(w.take_overflow, "the overflow flag")
        assert recv.receive_nowait() in {"k0", "k1", "k2", "k3"}  # type: ignore[attr-defined]

    with_watcher(1, body)


def test_a_removed_directory_is_reported_lost(tmp_path: Path) -> None:
    d = tmp_path / "gone"
    d.mkdir()

    async def body(w: Watcher, recv: anyio.abc.ObjectReceiveStream[str]) -> None:
        add(w, "g", d)
        assert w.watching("g")
        d.rmdir()
        lost: set[str] = set()

        def collect() -> bool:
            lost.update(w.take_lost())
            return "g" in lost

        await until(collect, "the lost watch")
        await until(lambda: not w.watching("g"), "the watch to be dropped")

    with_watcher(16, body)


def test_the_watch_is_pinned_to_the_opened_directory(tmp_path: Path) -> None:
    """The directory is swapped for a symlink between the kernel's open and its watch: the watch still lands on
    the directory that was opened, never on what the path now leads to."""
    real = tmp_path / "requests"
    real.mkdir()
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()

    async def body(w: Watcher, recv: anyio.abc.ObjectReceiveStream[str]) -> None:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
        try:
            real.rename(tmp_path / "moved")
            real.symlink_to(decoy)
            w.add("p", fd)
        finally:
            os.close(fd)
        add(w, "s", sentinel)
        commit(decoy, "planted")
        commit(sentinel, "tick")
        with anyio.fail_after(5):
            # One inotify queue delivers in order: had the decoy been watched, "p" would come first.
            assert await recv.receive() == "s"
        commit(tmp_path / "moved", "genuine")
        with anyio.fail_after(5):
            assert await recv.receive() == "p"

    with_watcher(16, body)
