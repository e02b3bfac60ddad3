"""Which kernel serves a channel: an advisory lock on the channel directory, held while it is served.

kernel.json's `owner` names the store that owns a channel, for the operator; the agent can write kernel.json, so it
cannot be what keeps two kernels off one channel. This lock is: a kernel serves (and writes the kernel files of) a
channel only while it holds `flock(LOCK_EX | LOCK_NB)` on the channel directory, so at most one process serves a
channel at a time, whatever the agent wrote. The lock goes with the process (also on SIGKILL), so a dead kernel
never keeps a channel. One fd per served channel: a dup of the fd `safefs.open_channel` opened (the same open file
description, so the lock is the one that fd took), kept until the channel is let go.

The agent can flock its own channel directory too: then no kernel serves that channel, which is reported as a
problem of that workspace only (a non-blocking try per channel, retried at each rescan; no other channel waits).
A filesystem that does not support flock on a directory (some NFS mounts) is served without the lock, and said.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final

from channel import safefs
from kernel.io import crash

# Errors meaning "this filesystem does not do flock here", not "somebody holds it".
_UNSUPPORTED: Final = frozenset({errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL})


class Unsupported(Exception):
    """flock does not work on this channel's filesystem; the channel is served without the lock."""


class HeldElsewhere(Exception):
    """Another process (a kernel serving the channel, another operator's command, or the agent) holds the lock."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        super().__init__(f"pid {pid}" if pid is not None else "pid not known")


def holder_pid(fd: int) -> int | None:
    """The pid /proc/locks names for a flock on the file behind `fd` (None if not found or not readable)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks a blocked waiter)
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[2] != "->" and parts[5] == want:
                    return int(parts[4])
    except (OSError, ValueError):
        return None
    return None


class Unlocker:
    """Closes the fds of the channel locks let go, on a thread of its own, in order. Closing the last fd of a locked
    directory is the unlock, which on a network filesystem is a call to the server and blocks while the server does
    not answer: so whoever lets a lock go (a store step, the service loop) never waits for it. Until its fd is
    closed the lock stays held; a close that hangs delays only the closes queued behind it (those locks are let go
    late), nothing else. The thread is a daemon: a hung close cannot keep the process from exiting, and the exit
    lets every lock go."""

    def __init__(self) -> None:
        self._fds: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    def close(self, key: str, fd: int) -> None:
        """Close `fd`, the lock of `key`'s channel, soon (on the unlocking thread)."""
        with self._mutex:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="channel-unlock", daemon=True)
                self._thread.start()
        self._fds.put((key, fd))

    def _run(self) -> None:
        while True:
            key, fd = self._fds.get()
            crash.hang_point("unlock", key)
            with contextlib.suppress(OSError):
                os.close(fd)


def _close_now(key: str, fd: int) -> None:
    os.close(fd)


class ChannelLocks:
    """The locks of the channels this process serves, by workspace key. A lock let go is closed by `close(key, fd)`:
    at once by default; the service passes an `Unlocker`'s (the unlock may block on a hung network filesystem)."""

    def __init__(self, close: Callable[[str, int], None] = _close_now) -> None:
        self._held: dict[str, tuple[safefs.Identity, int | None]] = {}
        self._close = close

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, key: str) -> bool:
        return key in self._held

    def hold(self, key: str, ch: safefs.Channel) -> str | None:
        """Take (or keep) the lock on `ch` for `key`. None when held; else why not, for the operator and the
        workspace's problem. Unsupported when the filesystem does not do flock (then the channel is recorded as
        held without a lock: the caller serves it and says so)."""
        had = self._held.get(key)
        if had is not None and had[0] == ch.identity:
            return None
        # Closed here and now (on the caller's thread: a look, never the store worker): the lock is taken again
        # next, which a close still pending would refuse when the new channel is the same directory.
        self.release(key, now=True)
        try:
            fd = os.dup(ch.fd)
        except OSError as exc:  # EMFILE: raise LimitNOFILE (one fd per served channel)
            return f"cannot lock the channel directory ({exc.strerror}); not served here"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = holder_pid(fd)
            os.close(fd)
            who = f"pid {pid}" if pid is not None else "pid not known"
            return (
                f"served by another kernel ({who}): another process holds the lock on the channel directory; not "
                "served here until it lets go"
            )
        except OSError as exc:
            os.close(fd)
            if exc.errno in _UNSUPPORTED:
                self._held[key] = (ch.identity, None)
                raise Unsupported(f"flock on the channel directory: {exc.strerror}") from None
            return f"cannot lock the channel directory ({exc.strerror}); not served here"
        self._held[key] = (ch.identity, fd)
        return None

    def release(self, key: str, *, now: bool = False) -> None:
        had = self._held.pop(key, None)
        if had is not None and had[1] is not None:
            # Closing the last fd of the open file description drops the lock.
            (_close_now if now else self._close)(key, had[1])

    def keep_only(self, keys: set[str]) -> None:
        # `list` copies the keys at once: look and enrollment threads may `hold` meanwhile.
        for key in [k for k in list(self._held) if k not in keys]:
            self.release(key)


def probe(ch: safefs.Channel, own_kernel: int | None) -> str | None:
    """For an operator's `enroll` (which keeps no lock): why another process serves the channel, or None when
    nobody holds its lock, the holder is `own_kernel` (this state dir's `serve`), or flock is not supported."""
    fd = os.dup(ch.fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = holder_pid(fd)
        os.close(fd)
        if pid is not None and pid == own_kernel:
            return None
        who = f"pid {pid}" if pid is not None else "pid not known"
        return f"served by another kernel ({who}): another process holds the lock on the channel directory"
    except OSError:
        os.close(fd)
        return None
    # Unlocked explicitly: closing a dup leaves the lock on the open file description, which `ch.fd` keeps
    # open, so a kernel picking the new workspace up found the channel "held elsewhere" until the rescan.
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


@contextlib.contextmanager
def held_briefly(ch: safefs.Channel, *, wait_s: float) -> Iterator[bool]:
    """The channel's lock, held by a process that does not serve the channel, for one short write of a
    kernel-written file (the operator's `budget`, kernel.io.enroll.publish_budget): while it is held no kernel serves
    the channel nor starts to (a kernel's try meanwhile fails, shows as the workspace's problem, and is made again
    at its next rescan). Another holder is waited for up to `wait_s` (another operator's command holds it as
    briefly); past that HeldElsewhere. Yields True when held, False when the filesystem does not do flock (then
    nothing keeps a kernel off the channel meanwhile)."""
    fd = os.dup(ch.fd)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise HeldElsewhere(holder_pid(fd)) from None
                time.sleep(0.02)
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                yield False
                return
        try:
            yield True
        finally:
            # Unlocked explicitly: `ch.fd` shares the open file description, and stays open after this fd closes.
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
