"""Run one git listing over a workspace's live tree, bounded: a deadline, a watch for a blocked open, an output cap.

`git ls-files --others` walks the agent's tree and opens every `.gitignore` it meets. The tree is hostile: a
`.gitignore` that is a FIFO blocks git's open() until someone writes to it (forever, if the agent never does), and
a tree of millions of untracked files makes git print without end. So the listing here:
- ends at `deadline` seconds, its whole process group killed (`ListingTimeout`): it never holds a heavy slot past
  that, whatever the tree does, a regular `.gitignore` swapped for a FIFO after any check included;
- watches git while it runs: git blocked `STALL_S` in one open() of a FIFO, socket or device inside the workspace
  (read from `/proc/<pid>/syscall` and the path from `/proc/<pid>/mem`, git being the kernel's own child, or
  bwrap's in the jail) is killed at once, naming the path (`ListingBlocked`); where /proc cannot tell, the
  deadline still holds;
- keeps at most `max_bytes` of output and `max_records` NUL-terminated records (`ListingTooLarge`), so memory is
  bounded before the caller counts anything;
- runs git with its address space capped at `max_memory` (RLIMIT_AS, set by the shell that execs it, before git
  starts): git reads each `.gitignore` whole into memory, and a sparse one of terabytes would otherwise take as
  much of the kernel machine's memory as git can read in the deadline. Past the cap git fails ("Out of memory"),
  which is the caller's exit status, not an exception.
The `ListingError` exceptions are the agent's to fix (its tree cannot be listed), never the kernel's outage.

This is the one place the snapshot starts a git that reads the live tree (kernel.io.snapshot). With a `jail` (the
kernel's jail is bwrap) git runs in `kernel.node.jail.listing_bwrap_argv`: every namespace unshared, no network,
the system directories, the workspace (bound from the directory fd the kernel opened) and the kernel's scratch git
directory read-only, nothing else of the host. bwrap runs git as pid 1 of its pid namespace and writes its host pid
to a pipe (`--info-fd`); the watch reads that process's /proc (the kernel created its user namespace, so it may),
and a kill of that process ends the namespace, `--die-with-parent` ending it too should bwrap die first. A jail
that cannot start is `ListingJailFailed`, the kernel's side, never the agent's.
Without a jail (jail = none or apptainer) git runs on the host as the kernel's user, unjailed: it only lists names
and lstat()s entries here, and the content of every listed file is read by the kernel itself through O_NOFOLLOW
directory fds, so a directory swapped for a symlink mid-walk can only add names (read, if at all, from inside the
workspace) or block git (the watch or the deadline ends it); but git parses the index copy and the `.gitignore`
files on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import stat
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO, Final

from kernel.io import hostproc
from kernel.node.jail import JAIL_PATH, JailPolicy, listing_bwrap_argv

LISTING: Final = hostproc.declare(
    "git.listing",
    agent_input="the workspace's live tree: names, entry types and `.gitignore` contents, and the copy of its index, "
    "parsed by git (file contents are read by the kernel itself, through O_NOFOLLOW directory fds)",
    containment="jail = bwrap: the listing jail (kernel.node.jail.listing_bwrap_argv: every namespace unshared, no "
    "network, the system directories, the workspace and the scratch git directory read-only, nothing else of the "
    "host, --die-with-parent); jail = none or apptainer: unjailed, logged at start (snapshot_listing_unjailed). "
    "Either way the caller's git with an environment built from nothing against a kernel-owned copy of the index "
    "(never the agent's .git), its own session, a deadline (LIST_DEADLINE_S), a watch that kills it 50 ms into an "
    "open() of a FIFO, socket or device, caps on files and bytes listed, RLIMIT_AS",
)
STALL_S: Final = 0.05
_POLL_S: Final = 0.01
_MAX_STDERR: Final = 64 * 1024
_MAX_INFO: Final = 64 * 1024  # bwrap's info JSON: a pid and six namespace ids
_GONE_S: Final = 5.0  # how long a killed jailed listing may take to be gone (it takes milliseconds)
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


class ListingJailFailed(Exception):
    """The listing's jail could not start (bwrap's own error, the message): the kernel's side, not the agent's."""


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


class _Jailed:
    """The jailed listing process: bwrap's child, pid 1 of its namespace, by the host pid bwrap wrote to its info
    fd. Held by a pidfd where the machine has them, so a kill never reaches a process that reused the pid; trusted
    only once /proc says its parent is `bwrap_pid` (the pidfd opened first, so the check is of that process)."""

    def __init__(self, pid: int, fd: int | None) -> None:
        self.pid = pid
        self._fd = fd

    @classmethod
    def of(cls, info: bytes, bwrap_pid: int) -> _Jailed | None:
        try:
            pid = json.loads(info)["child-pid"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(pid, int) or pid <= 0:
            return None
        fd: int | None
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already, or no pidfds here: then the pid alone
            fd = None
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            ppid = -1
        if ppid != bwrap_pid:
            if fd is not None:
                os.close(fd)
            return None
        return cls(pid, fd)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)

    def wait_gone(self, timeout: float) -> None:
        """Until the process has exited (its pidfd readable), at most `timeout` seconds; its namespace is gone by
        then (a pid namespace's init exits after every other process in it)."""
        if self._fd is not None:
            select.select([self._fd], [], [], timeout)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def run_listing(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    *,
    deadline: float,
    max_bytes: int,
    max_records: int | None,
    max_memory: int,
    jail: JailPolicy | None = None,
    readable: Sequence[str] = (),
) -> tuple[int, bytes, str]:
    """(exit status, stdout, last stderr line) of `argv` run in `cwd` (the workspace's root), bounded as the
    module says: ListingBlocked, ListingTimeout or ListingTooLarge, the process (and, jailed, its namespace) killed
    first. With `jail` (a bwrap policy) it runs in `listing_bwrap_argv`, `readable` (kernel-owned paths `argv`
    reads: the scratch git directory) bound read-only; ListingJailFailed when that jail cannot start.

    Agent-controlled input it touches: the workspace's tree below `cwd` (names, entry types, `.gitignore`
    contents) and the index copy `env` names, read by git; contained by the jail when given, the deadline, the
    blocked-open watch, the output caps and the memory cap; the process is the caller's git with a complete
    environment (`env`), no stdin, its own session."""
    # `ulimit -v` (KiB) is RLIMIT_AS of the shell, inherited by the git it execs in its place (same pid).
    limited = ["/bin/sh", "-c", 'ulimit -v "$0" && exec "$@"', str(max(1, max_memory // 1024)), *argv]
    if jail is None:
        proc = hostproc.popen(
            LISTING,
            limited,
            env=dict(env),
            cwd=cwd,
            stdin=hostproc.DEVNULL,
            stdout=hostproc.PIPE,
            stderr=hostproc.PIPE,
            start_new_session=True,
        )
        return _watch(proc, None, cwd, deadline, max_bytes, max_records)
    ws_fd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info_r, info_w = os.pipe()
        try:
            command = listing_bwrap_argv(
                jail,
                workspace=cwd,
                workspace_fd=ws_fd,
                readable=readable,
                env=env,
                info_fd=info_w,
                argv=limited,
            )
            proc = hostproc.popen(
                LISTING,
                command,
                env={"PATH": env.get("PATH", JAIL_PATH)},  # bwrap's own; git's is `env`, set in the jail
                cwd="/",
                stdin=hostproc.DEVNULL,
                stdout=hostproc.PIPE,
                stderr=hostproc.PIPE,
                start_new_session=True,
                pass_fds=(ws_fd, info_w),
            )
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
    finally:
        os.close(ws_fd)
    with open(info_r, "rb", buffering=0) as info:
        rc, out, why = _watch(proc, info, cwd, deadline, max_bytes, max_records)
    if rc == 1 and why.startswith("bwrap:"):  # bwrap's own failure (git ls-files never exits 1 here)
        raise ListingJailFailed(why)
    return rc, out, why


def _watch(
    proc: hostproc.Popen[bytes],
    info: BinaryIO | None,
    root: str,
    deadline: float,
    max_bytes: int,
    max_records: int | None,
) -> tuple[int, bytes, str]:
    """Drive `proc` to its end under the module's bounds, killing it (its process group, and the jailed process
    whose host pid bwrap writes to `info`) on every way out but its own exit."""
    assert proc.stdout is not None
    assert proc.stderr is not None
    out: list[bytes] = []
    size = records = 0
    err = b""
    said = b""  # what bwrap wrote to its info fd so far
    jailed: _Jailed | None = None
    watched: int | None = proc.pid if info is None else None  # the pid whose open()s are watched, once known
    end = time.monotonic() + deadline
    seen: tuple[str, float] | None = None  # the open git is in, and since when
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            sel.register(proc.stderr, selectors.EVENT_READ)
            if info is not None:
                sel.register(info, selectors.EVENT_READ)
            while sel.get_map():
                for ready, _ in sel.select(_POLL_S):
                    chunk = os.read(ready.fd, 1 << 20)
                    if ready.fileobj is info:
                        said = (said + chunk)[:_MAX_INFO]
                        if not chunk:
                            sel.unregister(info)
                            jailed = _Jailed.of(said, proc.pid)
                            watched = None if jailed is None else jailed.pid
                    elif not chunk:
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
                got = None if watched is None else blocked_open(watched)
                if got is None:
                    seen = None
                elif seen is None or seen[0] != got[0]:
                    seen = (got[0], now)
                elif now - seen[1] >= STALL_S and (rel := special_in(root, got[1])) is not None:
                    raise ListingBlocked(rel)
        rc = proc.wait(max(0.0, end - time.monotonic()))
    except hostproc.TimeoutExpired:
        raise ListingTimeout(f"did not finish within {deadline:g} s") from None
    finally:
        if proc.poll() is None:
            if jailed is not None:
                jailed.kill()
            with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if jailed is not None:
                jailed.wait_gone(_GONE_S)
        if jailed is not None:
            jailed.close()
        proc.stdout.close()
        proc.stderr.close()
    lines = err.decode("utf-8", "replace").strip().splitlines()
    return rc, b"".join(out), lines[-1] if lines else f"exit {rc}"
