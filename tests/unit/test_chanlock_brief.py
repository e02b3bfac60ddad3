"""kernel.io.chanlock.held_briefly: the channel lock an operator's command holds across one write of budget.json,
on real directories with real flock (kernel.io.enroll.publish_budget)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from channel import safefs
from kernel.io import chanlock


def channel(tmp_path: Path) -> safefs.Channel:
    (tmp_path / "ws").mkdir()
    return safefs.open_channel(tmp_path / "ws", create=True)


def test_while_held_no_kernel_takes_the_channel_and_after_it_does(tmp_path: Path) -> None:
    with channel(tmp_path) as ch, safefs.open_channel(tmp_path / "ws") as kernels:
        locks = chanlock.ChannelLocks()
        with chanlock.held_briefly(ch, wait_s=0) as held:
            assert held
            why = locks.hold("k", kernels)
            assert why is not None
            assert f"pid {os.getpid()}" in why
        assert locks.hold("k", kernels) is None  # let go: the kernel's next try takes it
        locks.release("k")


def test_another_short_holder_is_waited_for(tmp_path: Path) -> None:
    with channel(tmp_path) as ch:
        other = os.open(tmp_path / "ws" / ".syscall", os.O_RDONLY | os.O_DIRECTORY)  # another command's lock
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        threading.Timer(0.2, os.close, args=(other,)).start()
        start = time.monotonic()
        with chanlock.held_briefly(ch, wait_s=5) as held:
            assert held
        assert time.monotonic() - start < 4


def test_a_holder_past_the_wait_is_named(tmp_path: Path) -> None:
    with channel(tmp_path) as ch, safefs.open_channel(tmp_path / "ws") as kernels:
        locks = chanlock.ChannelLocks()
        assert locks.hold("k", kernels) is None
        try:
            with pytest.raises(chanlock.HeldElsewhere) as caught, chanlock.held_briefly(ch, wait_s=0.1):
                pass
            assert caught.value.pid == os.getpid()
        finally:
            locks.release("k")
