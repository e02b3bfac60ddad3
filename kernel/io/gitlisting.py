"""Run one git listing over a workspace's live tree, bounded: a deadline, a watch for a blocked open, an output cap.

`git ls-files --others` walks the agent's tree and opens every `.gitignore` it meets. The tree is hostile: a
`.gitignore` that is a FIFO blocks git's open() until someone writes to it (forever, if the agent never does), and
a tree of millions of untracked files makes git print without end. So the listing here:
- ends at `deadline` seconds, its whole process group killed (`ListingTimeout`): it never holds a heavy slot past
  that, whatever the tree does, a regular `.gitignore` swapped for a FIFO after any check included;
- watches git while it runs: git blocked `STALL_S` in one open() of a FIFO, socket or device inside the workspace
  (read from `/proc/<pid>/syscall` and the path from `/proc/<pid>/mem`, git being the kernel's own child) is killed
  at once, naming the path (`ListingBlocked`); where /proc cannot tell, the deadline still holds;
- keeps at most `max_bytes` of output and `max_records` NUL-terminated records (`ListingTooLarge`), so memory is
  bounded before the caller counts anything;
- runs git with its address space capped at `max_memory` (RLIMIT_AS, set by the shell that execs it, before git
  starts): git reads each `.gitignore` whole into memory, and a sparse one of terabytes would otherwise take as
  much of the kernel machine's memory as git can read in the deadline. Past the cap git fails ("Out of memory"),
  which is the caller's exit status, not an exception.
The exceptions are the agent's to fix (its tree cannot be listed), never the kernel's outage.

This is the one place the snapshot starts a git that reads the live tree (kernel.io.snapshot). It is not jailed:
git only lists names and lstat()s entries here; the content of every listed file is read by the kernel itself
through O_NOFOLLOW directory fds, so a directory swapped for a symlink mid-walk can only add names (read, if at
all, from inside the workspace) or block git (the deadline ends it).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import stat
import time
from collections.abc import Mapping, Sequence
from typing import Final

from kernel.io import hostproc

LISTING: Final = hostproc.declare(
    "git.listing",
    agent_input="the workspace's live tree: names, entry types and `.gitignore` contents, read by git (file "
    "contents are read by the kernel itself, through O_NOFOLLOW directory fds)",
    containment="the caller's git with an environment built from nothing against a kernel-owned copy of the "
    "index (never the agent's .git), its own session, a deadline (LIST_DEADLINE_S), a watch that kills it 50 ms "
    "into an open() of a FIFO, socket or device, caps on files and bytes listed, RLIMIT_AS",
)
STALL_S: Final = 0.05
_POLL_S: Final = 0.01
_MAX_STDERR: Final = 64 * 1024
_AT_FDCWD: Final = -100
# The open syscalls and which argument is the path, by machine (/proc/<pid>/syscall gives the number and args).
_OPENS: Final[dict[str, dict[int, int]]] = {
    "x86_64": {2: 0, 257: 1, 437: 1},  # open, openat, openat2
    "aarch64": {56: 1, 437: 1},  # openat, openat2
}
_SPECIAL: Final = (stat.S_ISFIFO, stat.S_ISSOCK, stat.S_ISCHR, stat.S_ISBLK)


class ListingError(Exception):
    """The workspace's tree cannot be listed (the agent's to fix)."""


class ListingBlocked(ListingError):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path  # relative to the workspace


class ListingTimeout(ListingError):
    pass


class ListingTooLarge(ListingError):
    """The listing's output is past a cap; the message says which ("more than N files", "... bytes of file
    names")."""


def blocked_open(pid: int) -> tuple[str, str] | None:
    """(the /proc/<pid>/syscall line, the absolute path) when `pid` is inside an open syscall now; None when it
    is not, or /proc does not tell (another machine, no permission: then only the deadline holds)."""
    opens = _OPENS.get(os.uname().machine)
    try:
        with open(f"/proc/{pid}/syscall", "rb") as f:
            line = f.read().decode()
        fields = line.split()
        if opens is None or not fields or not fields[0].isdigit() or int(fields[0]) not in opens:
            return None
        args = [int(a, 16) for a in fields[1:7]]
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.pread(fd, 4096, args[opens[int(fields[0])]])
        finally:
            os.close(fd)
        path = os.fsdecode(raw.split(b"\0", 1)[0])
        if not os.path.isabs(path):
            dirfd = args[0] - (1 << 64) if args[0] >= 1 << 63 else args[0]
            if opens[int(fields[0])] == 1 and dirfd not in (_AT_FDCWD, _AT_FDCWD & 0xFFFFFFFF):
                base = os.readlink(f"/proc/{pid}/fd/{dirfd}")
            else:
                base = os.readlink(f"/proc/{pid}/cwd")
            path = os.path.join(base, path)
        return line, os.path.normpath(path)
    except (OSError, ValueError, IndexError):
        return None


def special_in(root: str, path: str) -> str | None:
    """`path` relative to `root` when it lies inside `root` and is a FIFO, socket or device (lstat: no link
    followed, nothing opened); None otherwise."""
    rel = os.path.relpath(path, root)
    if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
        return None
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return rel if any(test(mode) for test in _SPECIAL) else None


def run_listing(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    *,
    deadline: float,
    max_bytes: int,
    max_records: int | None,
    max_memory: int,
) -> tuple[int, bytes, str]:
    """(exit status, stdout, last stderr line) of `argv` run in `cwd` (the workspace's root), bounded as the
    module says: ListingBlocked, ListingTimeout or ListingTooLarge, the process group killed first.

    Agent-controlled input it touches: the workspace's tree below `cwd` (names, entry types, `.gitignore`
    contents), read by git; contained by the deadline, the blocked-open watch, the output caps and the memory cap;
    the process is the caller's git with a complete environment (`env`), no stdin, its own session."""
    proc = hostproc.popen(
        LISTING,
        # `ulimit -v` (KiB) is RLIMIT_AS of the shell, inherited by the git it execs in its place (same pid).
        ["/bin/sh", "-c", 'ulimit -v "$0" && exec "$@"', str(max(1, max_memory // 1024)), *argv],
        env=dict(env),
        cwd=cwd,
        stdin=hostproc.DEVNULL,
        stdout=hostproc.PIPE,
        stderr=hostproc.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    out: list[bytes] = []
    size = records = 0
    err = b""
    end = time.monotonic() + deadline
    seen: tuple[str, float] | None = None  # the open git is in, and since when
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            sel.register(proc.stderr, selectors.EVENT_READ)
            while sel.get_map():
                for ready, _ in sel.select(_POLL_S):
                    chunk = os.read(ready.fd, 1 << 20)
                    if not chunk:
                        sel.unregister(ready.fileobj)
                    elif ready.fileobj is proc.stderr:
                        err = (err + chunk)[-_MAX_STDERR:]
                    else:
                        out.append(chunk)
                        size += len(chunk)
                        records += chunk.count(b"\0")
                        if max_records is not None and records > max_records:
                            raise ListingTooLarge(f"more than {max_records} files")
                        if size > max_bytes:
                            raise ListingTooLarge(f"more than {max_bytes} bytes of file names")
                now = time.monotonic()
                if now > end:
                    raise ListingTimeout(f"did not finish within {deadline:g} s")
                got = blocked_open(proc.pid)
                if got is None:
                    seen = None
                elif seen is None or seen[0] != got[0]:
                    seen = (got[0], now)
                elif now - seen[1] >= STALL_S and (rel := special_in(cwd, got[1])) is not None:
                    raise ListingBlocked(rel)
        rc = proc.wait(max(0.0, end - time.monotonic()))
    except hostproc.TimeoutExpired:
        raise ListingTimeout(f"did not finish within {deadline:g} s") from None
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    lines = err.decode("utf-8", "replace").strip().splitlines()
    return rc, b"".join(out), lines[-1] if lines else f"exit {rc}"
