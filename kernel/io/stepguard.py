"""No filesystem call inside a store step: a guard the test suite (or a debugging operator) turns on.

A store step (`StoreWorker.call` / `run_here`) holds the store's lock, which every other store step of every
workspace waits for. So a step uses sqlite and memory only: a file it touched (a workspace's channel, a run
directory on a shared filesystem that can hang, the kernel's own files) would stall them all while it waits. The
files go before or after the step, in the pool that owns them (kernel.service.chanio, kernel.service.heavy).

`StoreWorker` marks the thread running a step (`enter`/`leave`: one thread-local attribute, all the production
code pays). `install()` then fails every filesystem call Python code makes on a marked thread: the audit events
of files and processes (`open`, `os.listdir`, `os.scandir`, `os.rename`, `subprocess.Popen`, ...; see the
Python audit events table), and the calls that raise no audit event (`os.stat`, `os.lstat`, `os.access`, ...,
so also `os.path.exists` and `Path.exists`), wrapped. The call raises `FileCallInStoreStep` and is recorded
(`found()`) and logged (`event=store_step_file_call`), so a caller that catches it still fails the test that made
it. It is never installed by default: the test suite installs it in its own process (tests/conftest.py), and a
kernel started with `SYSCALL_KERNEL_STORE_GUARD=1` does (tests/kernelproc.py starts the tests' kernels so).

Not counted: sqlite's own page I/O (C, no audit event; its `sqlite3.connect` is a file open and counts), and what
the interpreter reads for itself in a step (a module's first import, the source lines of a traceback).
"""

from __future__ import annotations

import functools
import linecache
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

from kernel.io import log

ENV: Final = "SYSCALL_KERNEL_STORE_GUARD"

# The audit events of the filesystem and of new processes (a process a step started would run with its lock held).
EVENTS: Final = frozenset(
    {
        "open",
        "os.chdir",
        "os.chflags",
        "os.chmod",
        "os.chown",
        "os.exec",
        "os.fork",
        "os.forkpty",
        "os.fwalk",
        "os.getxattr",
        "os.lchflags",
        "os.link",
        "os.listdir",
        "os.listxattr",
        "os.lockf",
        "os.mkdir",
        "os.posix_spawn",
        "os.remove",
        "os.removexattr",
        "os.rename",
        "os.rmdir",
        "os.scandir",
        "os.setxattr",
        "os.spawn",
        "os.symlink",
        "os.system",
        "os.truncate",
        "os.utime",
        "os.walk",
        "fcntl.flock",
        "fcntl.lockf",
        "glob.glob",
        "glob.glob/2",
        "mmap.__new__",
        "pathlib.Path.glob",
        "pathlib.Path.rglob",
        "shutil.chown",
        "shutil.copyfile",
        "shutil.copymode",
        "shutil.copystat",
        "shutil.copytree",
        "shutil.make_archive",
        "shutil.move",
        "shutil.rmtree",
        "shutil.unpack_archive",
        "sqlite3.connect",
        "subprocess.Popen",
        "tempfile.mkdtemp",
        "tempfile.mkstemp",
    }
)
# The `os` functions that touch the filesystem without an audit event.
UNAUDITED: Final = (
    "stat",
    "lstat",
    "fstat",
    "access",
    "statvfs",
    "fstatvfs",
    "readlink",
    "fsync",
    "fdatasync",
)
# Frames of the interpreter reading files for itself (an import, a traceback's source lines): not the step's I/O.
_OWN_READS: Final = frozenset(
    {
        "<frozen importlib._bootstrap>",
        "<frozen importlib._bootstrap_external>",
        "<frozen zipimport>",
        linecache.__file__,
    }
)

_local = threading.local()
_found: list[str] = []
_found_lock = threading.Lock()
_installed = False


class FileCallInStoreStep(RuntimeError):
    """A store step touched the filesystem (it holds the store's lock: every other store step waits for it)."""


def enter() -> None:
    """This thread runs a store step (under the store's lock) until `leave`."""
    _local.step = True


def leave() -> None:
    _local.step = False


def found() -> list[str]:
    """The filesystem calls made in store steps since the last `clear`, oldest first, each as
    `event(args) in a store step, on thread NAME`."""
    with _found_lock:
        return list(_found)


def clear() -> None:
    with _found_lock:
        _found.clear()


def _interpreter_reading() -> bool:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _OWN_READS:
            return True
        frame = frame.f_back
    return False


def _refuse(what: str, args: tuple[Any, ...]) -> None:
    _local.step = False  # what follows (recording, the exception's own lines) is the guard's, not the step's
    try:
        if _interpreter_reading():
            return
        shown = ", ".join(repr(a) for a in args[:2])
        line = f"{what}({shown}) in a store step, on thread {threading.current_thread().name}"
        with _found_lock:
            _found.append(line)
        log.event("store_step_file_call", logging.ERROR, call=line)
    finally:
        _local.step = True
    raise FileCallInStoreStep(
        f"{line}: a store step holds the store's lock and uses sqlite only; touch files before or after it, "
        "in the pool that owns them"
    )


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in EVENTS and getattr(_local, "step", False):
        _refuse(event, args)


def _guarded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "step", False):
            _refuse(f"os.{name}", args)
        return fn(*args, **kwargs)

    return call


def install() -> None:
    """From now on a filesystem call in a store step fails (for the rest of the process: an audit hook cannot be
    removed). Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    for name in UNAUDITED:
        real = getattr(os, name)
        wrapped = _guarded(name, real)
        setattr(os, name, wrapped)
        for supports in (
            os.supports_dir_fd,
            os.supports_fd,
            os.supports_follow_symlinks,
            os.supports_effective_ids,
        ):
            if real in supports:
                supports.add(wrapped)
    sys.addaudithook(_audit)
