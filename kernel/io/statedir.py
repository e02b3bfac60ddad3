"""The state directory: checked before use, and held by one kernel at a time.

`prepare` refuses a `state_dir` that is not a directory (a file, a dangling link) and creates a missing one only
when its parent exists (a typo such as `/var/lib/syscal-kernel/x` is an error, not a silently made tree).

`StateLock` is an `flock` on `<state_dir>/kernel.lock`, held for the life of `serve`: a second `serve` on the same
state dir fails at once with the holder's pid. The kernel writes its pid into the file after taking the lock, so
the pid read by a loser belongs to the process holding it (or, in the instant between the two, to the previous
holder). The lock goes with the process (the kernel closes nothing of it on exit: the OS releases it even after
SIGKILL), so a crashed kernel never leaves a stale lock. `holder` tells `status` and `check` whether a kernel is
alive on the state dir without disturbing it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Final

from kernel.core.statepaths import StatePaths

# The lock file's fixed size: the pid line and the latest status line, padded.
NOTE_BYTES: Final = 1024


class StateDirError(Exception):
    """The state dir cannot be used; the message names it and says what to do."""


class StateDirHeld(StateDirError):
    """Another live kernel holds the state dir."""

    def __init__(self, path: Path, pid: int | None) -> None:
        self.pid = pid
        who = f"pid {pid}" if pid is not None else "another process"
        super().__init__(
            f"state dir held by {who}: {path} is served by a running kernel; one kernel per state dir (stop it "
            "first, or give this one another state_dir)"
        )


def prepare(state_dir: str | os.PathLike[str], *, create: bool = True) -> bool:
    """Check the state dir: a directory we can write. A missing one is made (mode 0700) only if `create` and its
    parent exists. True when it was made now."""
    p = Path(state_dir)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        if not create:
            raise StateDirError(
                f"state_dir {p} does not exist (has the kernel run, or a workspace been enrolled?)"
            ) from None
        try:
            os.mkdir(p, 0o700)
        except FileNotFoundError:
            raise StateDirError(
                f"state_dir {p} does not exist and neither does its parent {p.parent}; create the parent (or fix "
                "the path in the config: key 'state_dir'); the kernel does not create a whole tree"
            ) from None
        except OSError as exc:
            raise StateDirError(f"state_dir {p} cannot be created: {exc.strerror}") from None
        return True
    except OSError as exc:
        raise StateDirError(f"state_dir {p} cannot be examined: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(
            f"state_dir {p} is not a directory (it is a {_kind(st.st_mode)}); point 'state_dir' at a directory"
        )
    if not os.access(p, os.W_OK | os.X_OK):
        raise StateDirError(f"state_dir {p} is not writable by uid {os.geteuid()}")
    return False


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "special file"


class StateLock:
    """The held lock; `release` (or process exit) lets another kernel in."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, state_dir: str | os.PathLike[str], *, attempts: int = 5) -> StateLock:
        path = StatePaths.at(state_dir).lock
        fd = _open(path, os.O_RDWR | os.O_CREAT)
        try:
            for attempt in range(attempts):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    # A `status` holding a shared lock for an instant looks the same: try again briefly.
                    if attempt == attempts - 1:
                        raise StateDirHeld(Path(state_dir), _read_pid(fd)) from None
                    time.sleep(0.05)
            os.ftruncate(fd, 0)
            os.pwrite(fd, _content(os.getpid(), "starting"), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def publish(self, line: str) -> None:
        """Put the kernel's status line after its pid (read by `status`). The file keeps its size, so this
        needs no new disk space: it works on a full disk, where `status` most needs to say `degraded`."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, _content(os.getpid(), line), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _content(pid: int, line: str) -> bytes:
    text = f"{pid}\n{' '.join(line.split())}".encode("utf-8", "replace")[: NOTE_BYTES - 1]
    return text + b"\n" + b" " * (NOTE_BYTES - 1 - len(text))


def note(state_dir: str | os.PathLike[str]) -> str | None:
    """The status line the kernel holding the state dir published last (None when none holds it)."""
    path = StatePaths.at(state_dir).lock
    if holder(state_dir) is None:
        return None
    with contextlib.suppress(OSError), open(path, "rb") as f:
        lines = f.read(NOTE_BYTES).decode("utf-8", "replace").split("\n")
        return lines[1].strip() if len(lines) > 1 else None
    return None


def holder(state_dir: str | os.PathLike[str]) -> int | None:
    """The pid of the live kernel holding the state dir (0 if it holds it but its pid is unreadable), or None."""
    path = StatePaths.at(state_dir).lock
    try:
        fd = _open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ENOENT,):
            raise
        if exc.errno == errno.ELOOP:
            raise StateDirError(f"{path} is a symlink; remove it") from None
        raise StateDirError(f"{path} cannot be opened: {exc.strerror}") from None


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).split(b"\n")[0].decode("ascii").strip())
    return None


# Below this much free space the state dir's filesystem counts as full: sqlite needs room for its WAL index
# (32 KiB) even to read the store.
FULL_BELOW: Final = 1 << 20


def store_unusable(state_dir: str | os.PathLike[str], db: Path, exc: BaseException) -> str:
    """For the operator, when sqlite cannot read or write the state store (`disk I/O error` on a full disk,
    `database is locked`, a damaged file): what failed, where, and what to do about it."""
    try:
        st = os.statvfs(state_dir)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if free is not None and free < FULL_BELOW:
        how = (
            f"the filesystem of state_dir {state_dir} is full ({free} bytes free): free space there "
            f"(`df -h {state_dir}`) and run it again; a running kernel goes on by itself once there is room"
        )
    else:
        how = (
            f"check the filesystem of state_dir {state_dir} (`df -h {state_dir}`, `dmesg`) and that uid "
            f"{os.geteuid()} may read and write {db} and its -wal and -shm files"
        )
    return f"the state store {db} cannot be used: {type(exc).__name__}: {exc}; {how}"
