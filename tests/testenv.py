"""Facts about the test environment that test modules import (never import `conftest`: there are several)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"


def python38() -> tuple[str | None, str]:
    """A working CPython 3.8 (the tool's oldest): `python3.8` on PATH, else pyenv's versions directory.

    Returns (path, "") or (None, where it was looked for). Each candidate is run to check its version: a pyenv
    shim on PATH for a version that is not installed does not count.
    """
    import shutil
    import subprocess

    root = Path(os.environ.get("PYENV_ROOT") or "/root/.pyenv") / "versions"
    candidates = [shutil.which("python3.8") or ""]
    candidates += [str(d / "bin" / "python3.8") for d in sorted(root.glob("3.8.*"), reverse=True)]
    for exe in filter(None, candidates):
        try:
            out = subprocess.run(
                [exe, "-c", "import sys; print(sys.version_info[:2] == (3, 8))"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except OSError:
            continue
        if out.stdout.strip() == "True":
            return exe, ""
    return None, f"no working python3.8 on PATH or under {root}/3.8.*/bin"


def need(component: str, available: bool, why: str) -> None:
    """Skip (locally) or fail (in CI) when `component` is not available."""
    if available:
        return
    message = f"{component} is not available: {why}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: tests needing {component} must run)")
    pytest.skip(message)


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: "64m") mounted at `where` for the block (root only: skipped locally
    without it, failed in CI)."""
    import subprocess

    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    need("a tmpfs mount", done.returncode == 0, f"mount -t tmpfs needs root: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(path: Path) -> None:
    """Take every byte left on `path`'s filesystem (into the file `path`)."""
    # suppress outermost: closing the file flushes what the last write left buffered, which fails too
    with contextlib.suppress(OSError), open(path, "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    # the last partial block too
    with contextlib.suppress(OSError), open(path, "ab") as f:
        while True:
            f.write(b"\0" * 512)
            f.flush()


def scratch_gone(scratch: Path, timeout: float = 30.0) -> None:
    """Until no job's scratch (`syscall-job-*`) is left below `scratch`: on the local backend a detached child of
    the wrapper removes it once exit-code is written (kernel.node.wrapper.remove_scratch), so it may still be
    going when the task's end is reported."""
    import time

    deadline = time.monotonic() + timeout
    while list(scratch.glob("syscall-job-*")):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the job's scratch was left behind: {sorted(scratch.glob('syscall-job-*'))}"
            )
        time.sleep(0.01)
