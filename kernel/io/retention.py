"""Retention's file work: measure and remove one sleep's run directory and delivered results, and the disk a
workspace's evidence uses (for `status`).

Nothing here follows a symlink. The run directory is the kernel's own, but jobs wrote into it (their artifacts
may be links anywhere): `shutil.rmtree` removes it through directory fds without following links (Linux:
`rmtree.avoids_symlink_attacks`). The results live in the agent's channel: they are reached through
`channel.safefs` (the channel pinned to its enrolled inode, `results` opened without following), and a
`results/<seq>` the agent swapped for a link or a file is unlinked as the entry it is, never followed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

from channel import safefs
from channel.paths import ChannelPaths, RunPaths
from kernel.core.records import WorkspaceRow
from kernel.core.retention import SleepAge

# `status` walks at most this many entries per tree; past it the figure is a lower bound ("at least").
USAGE_MAX_ENTRIES = 200_000


def _tree_bytes(top: str, dir_fd: int | None = None, limit: int = USAGE_MAX_ENTRIES) -> tuple[int, bool]:
    """(bytes of the regular files under `top`, complete?), links neither followed nor counted."""
    total, seen = 0, 0
    try:
        st = os.stat(top, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return 0, True
    if not stat.S_ISDIR(st.st_mode):
        return (st.st_size if stat.S_ISREG(st.st_mode) else 0), True
    for _root, _dirs, files, rfd in os.fwalk(top, dir_fd=dir_fd, follow_symlinks=False):
        for name in files:
            seen += 1
            if seen > limit:
                return total, False
            with contextlib.suppress(OSError):
                fst = os.stat(name, dir_fd=rfd, follow_symlinks=False)
                if stat.S_ISREG(fst.st_mode):
                    total += fst.st_size
    return total, True


def sleep_run_dir(run_dir: str, key: str, seq: int) -> Path:
    return RunPaths(Path(run_dir), key, seq, "_").sleep_dir


def run_bytes(run_dir: str, key: str) -> int:
    """What the workspace's run directories hold (counted up to USAGE_MAX_ENTRIES files)."""
    return _tree_bytes(os.fspath(Path(run_dir) / key))[0]


def with_run_bytes(run_dir: str, key: str, ages: list[SleepAge]) -> list[SleepAge]:
    """`ages` with each sleep's run-directory bytes."""
    return [replace(a, run_bytes=_tree_bytes(os.fspath(sleep_run_dir(run_dir, key, a.seq)))[0]) for a in ages]


def remove_run_dir(run_dir: str, key: str, seq: int) -> int:
    """Remove `<run_dir>/<key>/<seq>/`; the bytes it held."""
    path = sleep_run_dir(run_dir, key, seq)
    used, _ = _tree_bytes(os.fspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()
    return used


def remove_results(ws: WorkspaceRow, seq: int) -> int:
    """Remove the channel's `results/<seq>` (whatever the entry is, never followed); the bytes it held.
    safefs.ChannelMoved / Refused / OSError when the channel cannot be reached as enrolled."""
    with safefs.open_channel(ws.path, ws.identity) as ch:
        try:
            fd = ch.subdir(ChannelPaths.RESULTS)
        except FileNotFoundError:
            return 0
        try:
            name = str(seq)
            used, _ = _tree_bytes(name, dir_fd=fd)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return 0
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
            return used
        finally:
            os.close(fd)


def usage(run_dir: str, ws: WorkspaceRow) -> tuple[int, int, bool]:
    """(bytes under the workspace's run directories, bytes under its channel's results/, both complete?)."""
    runs, whole_runs = _tree_bytes(os.fspath(Path(run_dir) / ws.key))
    try:
        with safefs.open_channel(ws.path, ws.identity) as ch:
            fd = ch.subdir(ChannelPaths.RESULTS)
            try:
                results, whole_results = _tree_bytes(".", dir_fd=fd)
            finally:
                os.close(fd)
    except (safefs.ChannelMoved, safefs.Refused, OSError):
        results, whole_results = 0, False
    return runs, results, whole_runs and whole_results
