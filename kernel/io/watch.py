"""Noticing requests: ONE inotify reader for every channel, bridged into anyio; and the polling decision.

watchdog's per-directory `Observer.schedule` starts a thread per watch (1,000 channels -> 1,000 threads), so the
kernel uses watchdog's shared `InotifyFD` directly: one instance, one reader thread, one watch per channel's
`requests/` directory. The watch is added on `/proc/self/fd/N` of the directory fd that `safefs` opened and
verified, so it is pinned to that inode: nothing the agent swaps in later (a symlinked `.syscall` or `requests`)
can redirect it, which a path-based watch with IN_DONT_FOLLOW would only guarantee for the last component.

The reader thread hands workspace keys to the event loop (`deliver`, run on the loop: the service starts an idle
workspace's turn there and then, or queues the key on a bounded memory stream); a key already handed over and not
yet taken is not handed over again, so a flood in one channel costs one slot. A full stream, or an inotify queue overflow, sets
a flag that turns into a full rescan. Events only make the kernel faster: the service's periodic rescan is the
ground truth, and channels on network filesystems (where a write on another host raises no event) are polled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.lowlevel
from watchdog.observers import inotify_c as ic

from kernel.io.loopcall import call_soon

log = logging.getLogger("syscall-kernel")

# Network and cluster filesystems: writes made on another host raise no inotify event here.
NETWORK_FS: Final = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "glusterfs",
        "beegfs",
        "panfs",
        "afs",
        "9p",
        "virtiofs",
        "ocfs2",
        "gfs2",
        "wekafs",
        "orangefs",
        "pvfs2",
        "davfs",
        "ncpfs",
    }
)

# Names remembered per channel between two passes; past it, the channel is listed in full.
NAMES_PER_KEY: Final = 1024

# IN_CREATE too: a request made by mkfifo, symlink or link raises no other event, and events that name their
# request are all the pipeline reads until the next full listing (a refusal must not wait for the rescan).
MASK: Final = ic.Mask(
    ic.InotifyConstants.IN_MOVED_TO
    | ic.InotifyConstants.IN_CLOSE_WRITE
    | ic.InotifyConstants.IN_CREATE
    | ic.InotifyConstants.IN_DELETE_SELF
    | ic.InotifyConstants.IN_MOVE_SELF
    | ic.InotifyConstants.IN_ONLYDIR
)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every line of /proc/self/mountinfo."""
    mounts: list[tuple[str, str]] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mounts.append((_unescape(fields[4]), right.split()[0]))
    return mounts


def fs_type_of(path: str, mounts: Iterable[tuple[str, str]]) -> str:
    """The filesystem type of the mount holding `path` (absolute, resolved): the longest (last) match wins."""
    best, best_len = "unknown", -1
    for point, fstype in mounts:
        inside = path == point or point == "/" or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = fstype, len(point)
    return best


def is_network_fs(fstype: str) -> bool:
    base = fstype.split(".", 1)[0]
    return fstype in NETWORK_FS or base in NETWORK_FS or (base == "fuse" and fstype != "fuse")


def choose_mode(configured: str, fstype: str) -> str:
    """'inotify' or 'poll' for one workspace under the configured `watch` setting."""
    if configured == "auto":
        return "poll" if is_network_fs(fstype) else "inotify"
    return configured


def read_mounts() -> list[tuple[str, str]]:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


@dataclass
class _Queue:
    """The reader thread's view of what it has handed to the loop and not yet seen consumed."""

    queued: set[str]
    overflow: threading.Event


class Watcher:
    """One inotify instance and reader thread for every watched channel.

    `add`/`remove` are called from the event loop; the callbacks run on the reader thread and only touch
    `_lock`-protected maps before handing a key to the loop.
    """

    def __init__(self, deliver: Callable[[str], None]) -> None:
        # Run on the event loop with each key handed over; raises anyio.WouldBlock when it cannot take it.
        self._deliver = deliver
        self._token = anyio.lowlevel.current_token()
        self._fd = ic.InotifyFD()  # our own instance (not the process-wide singleton), stopped with us
        self._lock = threading.Lock()
        self._key_of_wd: dict[int, str] = {}
        self._wd_of_key: dict[str, int] = {}
        self._q = _Queue(queued=set(), overflow=threading.Event())
        self._lost: set[str] = set()
        # Per key, the request names events announced since the loop last took the key; None: too many (or a
        # lost watch), list the whole directory.
        self._names: dict[str, set[str] | None] = {}
        self._stopping = False

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._fd.start()

    def healthy(self) -> bool:
        return self._fd.is_alive() and not self._stopping

    def stop(self) -> None:
        """Stop the reader thread (call `join` off the event loop)."""
        with self._lock:
            self._stopping = True
        self._fd.stop()

    def join(self, timeout: float) -> None:
        self._fd.join(timeout)

    # -- watches -------------------------------------------------------------------------------------------

    def add(self, key: str, requests_fd: int) -> None:
        """Watch the directory open as `requests_fd` for `key`. OSError (e.g. ENOSPC: watch limit) propagates."""
        self.remove(key)
        wd = self._fd.add_callback(os.fsencode(f"/proc/self/fd/{requests_fd}"), MASK, self, ic.CallbackId(0))
        with self._lock:
            self._key_of_wd[wd] = key
            self._wd_of_key[key] = wd
            self._lost.discard(key)

    def remove(self, key: str) -> None:
        with self._lock:
            wd = self._wd_of_key.pop(key, None)
            if wd is not None:
                self._key_of_wd.pop(wd, None)
        if wd is not None:
            self._fd.remove_callbacks([(ic.WatchDescriptor(wd), ic.CallbackId(0))])

    def watching(self, key: str) -> bool:
        with self._lock:
            return key in self._wd_of_key

    def take_lost(self) -> set[str]:
        """Keys whose watch the kernel dropped (the directory was deleted or moved away): re-watch them."""
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def consumed(self, key: str) -> None:
        """The loop took `key` off the stream: a later event for it must be queued again."""
        with self._lock:
            self._q.queued.discard(key)

    def take_names(self, key: str) -> set[str] | None:
        """The names events announced for `key` since the last call: the pipeline reads just those; None
        means list the whole `requests/` (more than NAMES_PER_KEY names, a lost watch, or none recorded)."""
        with self._lock:
            return self._names.pop(key, None)

    def take_overflow(self) -> bool:
        if self._q.overflow.is_set():
            self._q.overflow.clear()
            return True
        return False

    # -- callbacks (reader thread) -------------------------------------------------------------------------

    def _hand_over(self, key: str) -> None:
        with self._lock:
            if key in self._q.queued or self._stopping:
                return
            self._q.queued.add(key)
        with contextlib.suppress(RuntimeError):  # the loop has finished (the kernel is exiting)
            call_soon(self._token, self._delivered, key)

    def _delivered(self, key: str) -> None:
        # (event loop) The hand-over, which the reader thread does not wait for.
        try:
            self._deliver(key)
        except anyio.WouldBlock:
            with self._lock:
                self._q.queued.discard(key)
            self._q.overflow.set()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the loop is shutting down
        except Exception:
            # Not the reader thread's to see any more: without this, the key would stay "handed over" and its
            # events would be dropped until the kernel restarts. A rescan lists every channel instead.
            log.exception("event=watch_hand_over_failed ws=%s", key)
            with self._lock:
                self._q.queued.discard(key)
            self._q.overflow.set()

    def on_event(self, event: ic.InotifyEvent) -> None:
        with self._lock:
            key = self._key_of_wd.get(event.wd)
        if key is None:
            return
        if event.is_delete_self or event.is_move_self:
            with self._lock:
                self._lost.add(key)
                self._names[key] = None
        elif event.name.startswith(b"."):
            return  # an in-flight temp file; its rename raises the event that matters
        else:
            name = os.fsdecode(event.name)
            with self._lock:
                if key not in self._names:
                    self._names[key] = {name}
                else:
                    names = self._names[key]
                    if names is not None:
                        names.add(name)
                        if len(names) > NAMES_PER_KEY:
                            self._names[key] = None
        self._hand_over(key)

    def on_watch_deleted(self, wd: ic.WatchDescriptor) -> None:
        with self._lock:
            key = self._key_of_wd.pop(wd, None)
            if key is not None and self._wd_of_key.get(key) == wd:
                del self._wd_of_key[key]
                self._lost.add(key)
        if key is not None:
            self._hand_over(key)

    def on_queue_overflow(self) -> None:
        log.warning("event=inotify_overflow detail=%s", "the kernel's inotify queue overflowed; rescanning")
        self._q.overflow.set()
        # Wake the loop even if nothing else is queued; the key itself is never a workspace.
        self._hand_over("")
