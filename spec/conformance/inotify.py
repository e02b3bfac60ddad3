"""A minimal inotify reader (Linux, through libc with ctypes): what happened to which name in a directory.

The runner uses it to see HOW a file came to be, which reading the file cannot show: an answer that arrives by
`rename` (IN_MOVED_TO) was written atomically; one that is written through its final name (IN_MODIFY,
IN_CLOSE_WRITE on that name) was not. The kernel's watcher uses watchdog; this stays a few dozen lines of
standard library so the runner has no other dependency than the protocol's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
from dataclasses import dataclass
from typing import Final

IN_MODIFY: Final = 0x00000002
IN_ATTRIB: Final = 0x00000004
IN_CLOSE_WRITE: Final = 0x00000008
IN_MOVED_FROM: Final = 0x00000040
IN_MOVED_TO: Final = 0x00000080
IN_CREATE: Final = 0x00000100
IN_DELETE: Final = 0x00000200
IN_Q_OVERFLOW: Final = 0x00004000
# set in an event's mask when the entry is a directory
IN_ISDIR: Final = 0x40000000
WATCHED: Final = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_IN_NONBLOCK: Final = 0o4000
_IN_CLOEXEC: Final = 0o2000000
_HEADER: Final = struct.Struct("iIII")


@dataclass(frozen=True, slots=True)
class Event:
    """One inotify event: `directory` is the watched path as given, `name` the entry it concerns."""

    directory: str
    name: str
    mask: int
    cookie: int


class Unavailable(Exception):
    """inotify cannot be used here (not Linux, no libc, or the watch limit is reached)."""


class Watcher:
    """Records every event on the given directories from start() until stop(), on a background thread."""

    def __init__(self, directories: list[str]) -> None:
        libc_name = ctypes.util.find_library("c")
        if libc_name is None:
            raise Unavailable("no C library to call inotify through")
        try:
            libc = ctypes.CDLL(libc_name, use_errno=True)
            init = libc.inotify_init1
            self._add = libc.inotify_add_watch
        except (OSError, AttributeError):
            raise Unavailable("this C library has no inotify (not Linux?)") from None
        self._fd = init(_IN_NONBLOCK | _IN_CLOEXEC)
        if self._fd < 0:
            raise Unavailable(f"inotify_init1 failed: {os.strerror(ctypes.get_errno())}")
        self._dirs: dict[int, str] = {}
        for d in directories:
            wd = self._add(self._fd, os.fsencode(d), WATCHED)
            if wd < 0:
                err = ctypes.get_errno()
                os.close(self._fd)
                raise Unavailable(f"cannot watch {d}: {os.strerror(err)} ({errno.errorcode.get(err, err)})")
            self._dirs[wd] = d
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="conformance-inotify", daemon=True)
        self.overflowed = False

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(10)
        for fd in (self._fd, self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fd = -1

    def events(self) -> list[Event]:
        """Everything seen so far (a copy); call `settle()` first to include what the kernel just did."""
        self.settle()
        with self._lock:
            return list(self._events)

    def settle(self) -> None:
        """Read what is queued now, on the caller's thread as well (so an event just made is not missed)."""
        self._drain()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd, self._stop_r], [], [])
            if self._stop_r in ready:
                self._drain()
                return
            self._drain()

    def _drain(self) -> None:
        with self._lock:
            if self._fd < 0:
                return
            while True:
                try:
                    buf = os.read(self._fd, 65536)
                except BlockingIOError:
                    return
                except OSError:
                    return
                off = 0
                while off + _HEADER.size <= len(buf):
                    wd, mask, cookie, length = _HEADER.unpack_from(buf, off)
                    raw = buf[off + _HEADER.size : off + _HEADER.size + length].rstrip(b"\0")
                    off += _HEADER.size + length
                    if mask & IN_Q_OVERFLOW:
                        self.overflowed = True
                        continue
                    if wd in self._dirs:
                        self._events.append(Event(self._dirs[wd], os.fsdecode(raw), mask, cookie))
