#!/usr/bin/env python3
"""The job wrapper: what runs on the node for one task of a launch, for every backend (local now, Slurm too).

`kernel.backends.jobscript` renders this file into `<launch dir>/job.sh` with its configuration embedded (sbatch copies
the script away, so it cannot read a sidecar). It is Python 3.8+ and stdlib only, because it runs on compute
nodes with whatever python3 they have, and because containment checks and atomic writes are far easier to get
right here than in sh. Everything it writes goes into the kernel-owned task directory, OUTSIDE the jail:

    started, stdout, stderr, ended, artifacts/, artifacts.log (JSON lines), exit-code (JSON, written last,
    atomically: temp file + rename)

Steps: find the task index (SLURM_ARRAY_TASK_ID or SWEEP_INDEX); read command.txt; materialise the snapshot into
node scratch straight from the objects of the KERNEL's repository of the workspace (`<run_dir>/repos/<key>.git`;
ls-tree + cat-file: no checkout machinery, so no hook, no filter, no `.git` in the tree; every blob re-hashed
and the tree id recomputed; the workspace's own `.git` is never read); run `sh -c COMMAND` in the jail, with the
locked environment's venv (the kernel's warm cache entry's, shared by every task) bound read-only;
copy declared artifacts out of the tree (contained, regular files, size-capped, every skip logged); write
exit-code; remove the scratch (on the local backend in a detached child, so the task's slot is free as soon as
exit-code is: `remove_scratch`). SIGTERM/SIGINT/SIGHUP (cancel, scheduler) and SIGUSR2 (the walltime warning)
stop the jail and are recorded, so a killed job still leaves an exit-code that says why.

Exit codes (the process status and `code` in exit-code): the command's own status, 128+N if a signal N killed it,
or one of the EXIT_* codes below; exit-code's `kind` tells them apart unambiguously.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import sys
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any

# subprocess, tempfile, shutil, threading, hashlib and traceback are imported where they are used: together
# they cost ~25 ms of interpreter start-up, which would otherwise come before `started` on every task.
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

EXIT_DISK_FULL = 118
EXIT_DISK_LIMIT = 119
EXIT_EMPTY_COMMAND = 120
EXIT_MATERIALISE_FAILED = 121
EXIT_TERMINATED = 122
EXIT_TIMEOUT = 123
EXIT_WRAPPER_ERROR = 124
EXIT_ENVIRONMENT_FAILED = 126

KIND_EXITED = "exited"
KIND_SIGNALED = "signaled"
KIND_EMPTY = "empty_command"
KIND_MATERIALISE = "materialise_failed"
KIND_TERMINATED = "terminated"
KIND_TIMEOUT = "timeout"
KIND_WRAPPER = "wrapper_error"
KIND_ENVIRONMENT = "environment_failed"
KIND_OOM = "out_of_memory"
KIND_DISK_FULL = "disk_full"  # the task directory's filesystem had no room left (ENOSPC, EDQUOT)
KIND_DISK_LIMIT = "disk_limit"  # the job's tree, home and work held more than the `tree_mb` limit

# The errors that mean "no room on this filesystem": a handled end of the task, never a crash.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Room for the exit record, allocated in the task directory before the job runs (see write_record).
RESERVE = ".exit-code.reserve"
RESERVE_BYTES = 16384
# How often the tree watchdog sums the job's disk use: every TREE_WATCH_MIN_S, or ten times as long as a sum
# takes (a tenth of a core on a big tree), up to TREE_WATCH_MAX_S; never sooner than a sum takes (half a core
# at most, on a tree of hundreds of thousands of files).
TREE_WATCH_MIN_S = 0.02
TREE_WATCH_MAX_S = 1.0
# A file this close to the per-file limit was stopped by it (glibc's posix_fallocate writes one byte a block).
FSIZE_SLACK = 65536

TREE_TOKEN = "@@SYSCALL_TREE@@"
HOME_TOKEN = "@@SYSCALL_HOME@@"
WORK_TOKEN = "@@SYSCALL_WORK@@"
ENV_TOKEN = "@@SYSCALL_ENV@@"
COMMAND_TOKEN = "@@SYSCALL_COMMAND@@"
SCORER_TOKEN = "@@SYSCALL_SCORER@@"
SCORE_DATA_TOKEN = "@@SYSCALL_SCORE_DATA@@"
VENV_TOKEN = "@@SYSCALL_VENV@@"
VENV_SOURCE_TOKEN = "@@SYSCALL_VENV_SOURCE@@"
GPU_TOKEN = "@@SYSCALL_GPUS@@"
# Set to "1" by the local backend (kernel.backends.jobscript.wrapper_env): the task's scratch is removed by a
# detached child once exit-code is written, so the slot (this process) is free at once.
DETACH_VAR = "SYSCALL_DETACH_CLEANUP"
GPU_CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")

# Replaced by kernel.backends.jobscript with the JSON text of this task's configuration.
CONFIG_JSON: str | None = None  # @@SYSCALL_CONFIG@@

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WrapperError(Exception):
    """A failure with the exit-code kind it maps to."""

    def __init__(self, kind: str, code: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.code = code


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # noqa: UP017 (datetime.UTC is 3.11+)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_ERRNOS


def write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    """Write all of `data` (a short write on a filing-up disk is followed by the write that raises ENOSPC)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset + len(data) - len(view))
        view = view[n:]


def _fsync_dir(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_atomic(directory: str, name: str, data: bytes, mode: int = 0o644) -> None:
    """Create `directory/name` with `data` via a fresh temp file and rename, fsyncing file and directory; a write
    that fails (a full disk) leaves no temp file behind."""
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def reserve_record(directory: str) -> None:
    """Allocate room for the exit record in `directory` now (RESERVE): on a disk that fills up later, the record
    is still written (write_record), so a task ended by a full disk says so. Raises OSError (ENOSPC) when even
    that much room is not there."""
    fd = os.open(
        os.path.join(directory, RESERVE), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
    )
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, RESERVE))
        raise
    os.close(fd)


def write_record(directory: str, name: str, data: bytes, mode: int = 0o644) -> None:
    """Write `directory/name` whole and atomically like write_atomic; with a reserve in `directory` the bytes go
    into the reserve's already allocated blocks (overwritten in place, cut to size, renamed over `name`), so a
    full disk does not stop it. The reserve is used once."""
    reserve = os.path.join(directory, RESERVE)
    try:
        fd = os.open(reserve, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        write_atomic(directory, name, data, mode)
        return
    try:
        if len(data) > RESERVE_BYTES:  # never longer in practice (a few hundred bytes): it just may allocate
            os.ftruncate(fd, 0)
        write_all(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(reserve, os.path.join(directory, name))
    _fsync_dir(directory)


def task_index(array: int, environ: dict[str, str]) -> int:
    raw = environ.get("SLURM_ARRAY_TASK_ID") or environ.get("SWEEP_INDEX")
    if raw is None:
        if array == 1:
            return 0
        raise WrapperError(
            KIND_WRAPPER, EXIT_WRAPPER_ERROR, "array task without SLURM_ARRAY_TASK_ID or SWEEP_INDEX"
        )
    if not raw.isdigit() or not 0 <= int(raw) < array:
        raise WrapperError(KIND_WRAPPER, EXIT_WRAPPER_ERROR, f"task index {raw!r} is not in 0..{array - 1}")
    return int(raw)


def task_dir_for(launch_dir: str, index: int, array: int) -> str:
    """Mirror of channel.paths.RunPaths.task_dir."""
    if array == 1:
        return launch_dir
    return f"{launch_dir.rstrip('/')}.{index}"


def env_args(kind: str, env: dict[str, str]) -> list[str]:
    """Mirror of kernel.node.jail.env_args (a unit test keeps the two equal)."""
    out: list[str] = []
    for key in sorted(env):
        if kind == "bwrap":
            out += ["--setenv", key, env[key]]
        elif kind == "apptainer":
            out += ["--env", f"{key}={env[key]}"]
    return out


def render_argv(
    template: list[str],
    kind: str,
    tree: str,
    home: str,
    work: str,
    env: dict[str, str],
    command: str,
    scorer: str = "",
    venv: str = "",
    gpus: list[str] | None = None,
    score_data: str = "",
    venv_source: str = "",
) -> list[str]:
    """Fill the jail template's tokens with node-side values: the env, the command and the GPU binds replace
    whole arguments; a path token may also sit inside one (apptainer's `SRC:DST:ro`)."""
    values = {
        TREE_TOKEN: tree,
        HOME_TOKEN: home,
        WORK_TOKEN: work,
        SCORER_TOKEN: scorer,
        VENV_TOKEN: venv,
        VENV_SOURCE_TOKEN: venv_source or venv,
    }
    if score_data:
        values[SCORE_DATA_TOKEN] = score_data
    out: list[str] = []
    for arg in template:
        if arg == ENV_TOKEN:
            out += env_args(kind, env)
        elif arg == COMMAND_TOKEN:
            out.append(command)
        elif arg == GPU_TOKEN:
            out += gpus or []
        else:
            for token, value in values.items():
                arg = arg.replace(token, value)
            out.append(arg)
    return out


def jail_program(name: str, path: str | None) -> str:
    """The jail program (`bwrap`, `apptainer`) found on the wrapper's own PATH, the one the kernel's start-up
    check searched (local backend: the kernel's PATH; Slurm: the node's), not on the job's PATH inside the jail
    (a Popen with `env` searches that one): a bwrap installed outside the standard directories is found."""
    if os.sep in name:
        return name
    import shutil

    return shutil.which(name, path=path) or name


def fill_env(env: dict[str, str], **paths: str) -> dict[str, str]:
    """Env values that are path tokens, filled with the node's paths (`tree=`, `home=`, `scorer=`, `data=`)."""
    tokens = {
        TREE_TOKEN: paths.get("tree"),
        HOME_TOKEN: paths.get("home"),
        SCORER_TOKEN: paths.get("scorer"),
        SCORE_DATA_TOKEN: paths.get("data"),
    }
    return {k: (tokens.get(v) or v) for k, v in env.items()}


def gpu_bind_args(visible: str | None, present: list[str], constrained: bool) -> list[str]:
    """Mirror of kernel.node.jail.gpu_bind_args (a unit test keeps the two equal)."""
    import re

    cards = sorted((n for n in present if re.match(r"^nvidia[0-9]+$", n)), key=lambda n: int(n[6:]))
    wanted = cards
    if not constrained and visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in ids):
            wanted = [n for n in cards if n[6:] in {str(int(v)) for v in ids}]
    out: list[str] = []
    names = wanted + [n for n in GPU_CONTROL if n in present]
    names += sorted(n for n in present if re.match(r"^dri/renderD[0-9]+$", n))
    for n in names:
        out += ["--dev-bind-try", "/dev/" + n, "/dev/" + n]
    return out


def dev_listing(dev: str = "/dev") -> list[str]:
    """The names under /dev that GPU binding looks at (`nvidia*` and `dri/*`)."""
    names: list[str] = []
    with contextlib.suppress(OSError):
        names += [n for n in os.listdir(dev) if n.startswith("nvidia")]
    with contextlib.suppress(OSError):
        names += ["dri/" + n for n in os.listdir(os.path.join(dev, "dri"))]
    return names


def job_env(
    config: dict[str, Any], index: int, home: str, environ: dict[str, str], venv: str = ""
) -> dict[str, str]:
    env = {k: (home if v == HOME_TOKEN else v.replace(VENV_TOKEN, venv)) for k, v in config["env"].items()}
    for name in config["index_vars"]:
        env[name] = str(index)
    sweep = config.get("sweep") or []
    if sweep:  # a swept launch: this task's values (the kernel checked there is one set per task)
        env.update(sweep[index])
    seeds = config.get("seeds") or []
    if seeds and config.get("seed_to_command", True):
        env["EVAL_SEED"] = str(seeds[index % len(seeds)])
    for name in config["forward_vars"]:
        if name in environ:
            env[name] = environ[name]
    return env


# --- materialising the snapshot -----------------------------------------------------------------------------


def valid_tree_path(path: bytes) -> bool:
    parts = path.split(b"/")
    return bool(path) and all(p not in (b"", b".", b"..") and p.lower() != b".git" for p in parts)


# The most directory fds a DirChain holds (materialising, copying the tree for the scorer): a tree's directories
# below this depth are reached by reopening component by component from the deepest one held.
DIR_CHAIN_CAP = 32


class DirChain:
    """The open directories of one path from a root fd down (the ancestors' chain), for visiting a tree in
    depth-first order with a bounded number of fds whatever its breadth or depth: `at(parts)` closes what lies
    off the new path and opens (creating them when `create`) the missing components, never through a symlink
    (O_NOFOLLOW on every component). At most `cap` fds of the chain stay open, plus one for a directory deeper
    than that; entries in tree order (each directory's entries contiguous) reopen each directory once."""

    def __init__(self, root_fd: int, *, create: bool, cap: int = DIR_CHAIN_CAP) -> None:
        self.root = root_fd
        self.create = create
        self.cap = cap
        self.names: list[str | bytes] = []  # the path the chain is at
        self.fds: list[int] = []  # fds[i] is the directory names[: i + 1] (i < cap)
        self.deep: int | None = None  # the directory `names` when it lies deeper than `cap`

    def at(self, parts: list[Any]) -> int:
        """The fd of directory `parts` below the root (owned by the chain: valid until the next call)."""
        k = 0
        while k < min(len(self.names), len(parts)) and self.names[k] == parts[k]:
            k += 1
        if k == len(self.names) == len(parts):
            return self.deep if self.deep is not None else (self.fds[-1] if self.fds else self.root)
        self._close_deep()
        while len(self.fds) > k:
            os.close(self.fds.pop())
        self.names = []
        cur = self.fds[-1] if self.fds else self.root
        for i in range(len(self.fds), len(parts)):
            if self.create and i >= k:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(parts[i], 0o755, dir_fd=cur)
            nfd = os.open(parts[i], _O_DIR, dir_fd=cur)
            if i < self.cap:
                self.fds.append(nfd)
            elif self.deep is None:
                self.deep = nfd
            else:
                os.close(self.deep)
                self.deep = nfd
            cur = nfd
        self.names = list(parts)
        return cur

    def _close_deep(self) -> None:
        if self.deep is not None:
            os.close(self.deep)
            self.deep = None

    def close(self) -> None:
        self._close_deep()
        while self.fds:
            os.close(self.fds.pop())
        self.names = []


def tree_order(path: bytes) -> list[bytes]:
    """Sort key putting every directory's entries together (depth first), as a recursive ls-tree lists them."""
    return path.split(b"/")


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            raise WrapperError(KIND_MATERIALISE, EXIT_MATERIALISE_FAILED, "git cat-file output ended early")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def tree_id_of(entries: list[tuple[bytes, bytes, bytes, bytes]]) -> str:
    """git's id of the tree holding exactly `entries` ((mode, kind, oid, path) of a recursive listing)."""
    import hashlib

    root: dict[bytes, Any] = {}
    for mode, _kind, oid, path in entries:
        *dirs, name = path.split(b"/")
        node = root
        for d in dirs:
            node = node.setdefault(d, {})
        node[name] = (mode, oid)

    def digest(node: dict[bytes, Any]) -> bytes:
        body = []
        for name in sorted(node, key=lambda n: n + b"/" if isinstance(node[n], dict) else n):
            item = node[name]
            if isinstance(item, dict):
                body.append(b"40000 " + name + b"\0" + digest(item))
            else:
                body.append(item[0] + b" " + name + b"\0" + bytes.fromhex(item[1].decode()))
        raw = b"".join(body)
        return hashlib.sha1(b"tree %d\0" % len(raw) + raw).digest()

    return digest(root).hex()


def materialise(git: dict[str, Any], tree: str, scratch: str) -> int:
    """Write the snapshot's files into the empty directory `tree`; returns the number of entries written.

    The snapshot is read from the KERNEL's repository of the workspace (never the agent's `.git`), and checked:
    every blob is re-hashed as it is read and the tree id is recomputed from the listing, so what runs is
    exactly the tree the kernel recorded."""
    import hashlib
    import subprocess

    def fail(message: str) -> WrapperError:
        return WrapperError(KIND_MATERIALISE, EXIT_MATERIALISE_FAILED, message)

    repo = git["repo"]
    try:
        gfd = os.open(repo, _O_DIR)
    except OSError as e:
        raise fail(f"cannot open the kernel's repository {repo} as a real directory: {e.strerror}") from None
    env = dict(git["env"])
    env["GIT_DIR"] = f"/proc/self/fd/{gfd}"
    env.pop("GIT_WORK_TREE", None)
    env.pop("GIT_INDEX_FILE", None)

    def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["git", "--no-pager", *args], env=env, cwd=scratch, pass_fds=(gfd,), capture_output=True, **kw
        )

    def listing_of(tree_id: str) -> list[tuple[bytes, bytes, bytes, bytes]]:
        """The recursive listing of `tree_id`, checked: it must hash back to that id."""
        listing = run(["ls-tree", "-r", "-z", "--full-tree", tree_id])
        if listing.returncode != 0:
            raise fail(f"the tree {tree_id} is not in {repo}: {listing.stderr.decode(errors='replace')}")
        out = []
        for rec in listing.stdout.split(b"\0"):
            if not rec:
                continue
            meta, _, path = rec.partition(b"\t")
            mode, kind, oid = meta.split(b" ")
            if not valid_tree_path(path):
                raise fail(f"snapshot holds an unsafe path {path!r}")
            out.append((mode, kind, oid, path))
        if tree_id_of(out) != tree_id:
            raise fail(f"the listing of {tree_id} in {repo} does not hash to that tree id")
        return out

    try:
        entries = listing_of(git["tree"])
        protected = git.get("protected")
        if protected:
            # Protected paths come from the base (held in the same kernel repository) whatever this side's tree
            # holds: this side's entries under a protected pattern are dropped and the base's are written instead.
            # So are the bytecode caches, interpreter hooks and same-named modules that could shadow a protected
            # file (`shadowing`: the kernel lists the same paths in the wake from the same listings).
            patterns = list(protected["patterns"])
            base_entries = listing_of(protected["tree"])
            dropped = {
                p.encode("utf-8", "surrogateescape")
                for p, _why in shadowing(
                    patterns, [_text(e[3]) for e in base_entries], [_text(e[3]) for e in entries]
                )
            }
            entries = [e for e in entries if e[3] not in dropped and not is_protected(patterns, _text(e[3]))]
            entries += [e for e in base_entries if is_protected(patterns, _text(e[3]))]
            entries.sort(key=lambda e: tree_order(e[3]))
        oids = os.path.join(scratch, "oids")
        with open(oids, "wb") as f:
            f.writelines(oid + b"\n" for mode, kind, oid, path in entries if kind == b"blob")
        chain = DirChain(os.open(tree, _O_DIR), create=True)
        try:
            with open(oids, "rb") as stdin:
                proc = subprocess.Popen(
                    ["git", "cat-file", "--batch"],
                    stdin=stdin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    env=env,
                    cwd=scratch,
                    pass_fds=(gfd,),
                )
            assert proc.stdout is not None
            try:
                for mode, kind, oid, path in entries:
                    *parents, name = path.split(b"/")
                    pfd = chain.at(parents)
                    if kind != b"blob":  # a submodule: only its (empty) directory
                        os.mkdir(name, 0o755, dir_fd=pfd)
                        continue
                    header = proc.stdout.readline().split()
                    if len(header) != 3 or header[0] != oid or header[1] != b"blob":
                        raise fail(f"git cat-file could not read blob {oid.decode()}")
                    data = _read_exact(proc.stdout, int(header[2]))
                    _read_exact(proc.stdout, 1)
                    if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != oid.decode():
                        raise fail(f"blob {oid.decode()} ({path!r}) in {repo} does not hash to its id")
                    if mode == b"120000":
                        os.symlink(data, name, dir_fd=pfd)
                        continue
                    perm = 0o755 if mode == b"100755" else 0o644
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, perm, dir_fd=pfd)
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view) :]
                    finally:
                        os.close(fd)
            finally:
                proc.stdout.close()
                proc.kill()
                proc.wait()
        finally:
            chain.close()
            os.close(chain.root)
        return len(entries)
    except (OSError, ValueError) as e:  # ValueError: a name or link target with a NUL byte
        raise fail(f"materialising the snapshot failed: {e}") from None
    finally:
        os.close(gfd)


# --- protected paths ---------------------------------------------------------------------------------------


def _match_parts(pattern: list[str], parts: list[str]) -> bool:
    import fnmatch

    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_parts(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], head) and _match_parts(rest, parts[1:])


def protected_match(pattern: str, path: str) -> bool:
    """Whether `path` (a '/'-separated path of the tree) is covered by one protected pattern: the pattern matches
    the path or one of its leading directories (`data/val` covers `data/val/x`); `*` and `?` stay within one
    component, `**` spans any number of them. (The kernel imports this one for the wake's list, so the wake names
    exactly the paths the node replaced.)"""
    pat = pattern.split("/")
    parts = path.split("/")
    return any(_match_parts(pat, parts[:i]) for i in range(1, len(parts) + 1))


def is_protected(patterns: list[str], path: str) -> bool:
    return any(protected_match(p, path) for p in patterns)


# What Python runs in place of (or before) a source file: bytecode, `.pth` lines and the site hooks.
BYTECODE_SUFFIXES = (".pyc", ".pyo")
HOOK_SUFFIXES = (".pth",)
HOOK_NAMES = ("sitecustomize.py", "usercustomize.py")
EXTENSION_SUFFIXES = (".so", ".pyd")


def shadowing(patterns: list[str], base_paths: list[str], paths: list[str]) -> list[tuple[str, str]]:
    """(path, why) for each of this side's paths (`paths`, not itself protected) that could run in place of a
    protected file: a bytecode cache (`__pycache__/` or `*.pyc`, which an unchecked-hash pyc makes Python load
    instead of the source), an interpreter hook (`*.pth`, `sitecustomize.py`, `usercustomize.py`), or, next to
    a protected module `d/m.py` of the base (`base_paths`), a package `d/m/` (or an entry `d/m`: a symlink to a
    directory is one) or an extension module `d/m.*.so` (both found before `m.py` by the import system). The node drops these when materialising a side with
    protected paths, and the kernel lists them in the wake from the same listings through this function."""
    modules = set()
    for p in base_paths:
        if p.endswith(".py") and is_protected(patterns, p):
            d, _, name = p.rpartition("/")
            modules.add((d, name[:-3]))
    out: list[tuple[str, str]] = []
    for p in paths:
        if is_protected(patterns, p):
            continue
        parts = p.split("/")
        name = parts[-1].lower()
        why = None
        if "__pycache__" in parts or name.endswith(BYTECODE_SUFFIXES):
            why = "a bytecode cache"
        elif name.endswith(HOOK_SUFFIXES) or name in HOOK_NAMES:
            why = "an interpreter hook"
        else:
            for i in range(len(parts)):
                d, stem = "/".join(parts[:i]), parts[i].split(".")[0]
                module = d + "/" + stem + ".py" if d else stem + ".py"
                if (d, stem) not in modules:
                    continue
                if parts[i] == stem:  # a directory `m/`, or an entry `m` (a symlink to one)
                    why = f"a package that shadows the protected {module}"
                elif i == len(parts) - 1 and name.endswith(EXTENSION_SUFFIXES):
                    why = f"an extension module that shadows the protected {module}"
                if why is not None:
                    break
        if why is not None:
            out.append((p, why))
    return out


def _text(path: bytes) -> str:
    return path.decode("utf-8", "surrogateescape")


# --- per-task limits (the local backend) --------------------------------------------------------------------

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_GROUP = "syscall-jobs"


def own_cgroups(text: str) -> dict[str, str]:
    """Parse /proc/self/cgroup: controller (or "" for the v2 hierarchy) -> path."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for c in parts[1].split(",") if parts[1] else [""]:
                out[c] = parts[2]
    return out


CPU_PERIOD_US = 100000


class Limiter:
    """Memory, CPU, process and OOM accounting for one task: a cgroup where this process can create one (v2: a
    `syscall-jobs/<task>` group with memory.max, memory.swap.max, cpu.max and pids.max; v1: one group per
    controller below our own), else rlimits (RLIMIT_AS, RLIMIT_NPROC: weaker, see docs/operator.md). The jail is
    moved into the group before it execs, so everything it forks is counted and, at the end, killed. A CPU limit
    is a CPU-time quota of `cpus` CPUs where a cgroup's cpu controller is there, else (`cpu_by` "affinity") the
    jail is pinned to `cpus` of the CPUs this process may use, the `slot`-th such block (tasks of one launch
    side by side)."""

    def __init__(self, limits: dict[str, Any], name: str, root: str = CGROUP_ROOT) -> None:
        self.mem_mb = int(limits.get("mem_mb") or 0)
        self.cpus = int(limits.get("cpus") or 0)
        self.slot = int(limits.get("slot") or 0)
        self.cpu_by = "none"
        self.max_procs = int(limits.get("max_procs") or 0)
        self.tree_mb = int(
            limits.get("tree_mb") or 0
        )  # also the largest file the job may write (RLIMIT_FSIZE)
        self.gpus = int(limits.get("gpus") or 0)
        self.name = name
        self.root = root
        self.mechanism = "none"
        self.groups: list[str] = []  # every cgroup directory the jail joins
        self.memory_group: str | None = None
        self.v2 = False

    @property
    def wanted(self) -> bool:
        """Whether `enter` has something to do in the jail's process."""
        return bool(self.mem_mb or self.max_procs or self.tree_mb or self.cpus)

    def setup(self) -> str:
        if not (self.mem_mb or self.max_procs or self.cpus):
            return "none"
        for attempt in (self._v2, self._v1):
            try:
                if attempt():
                    self.mechanism = "cgroup"
                    break
            except OSError:
                self._remove()
                self.cpu_by = "none"
        else:
            self.mechanism = "rlimit"
        if self.cpus and self.cpu_by == "none":
            self.cpu_by = "affinity"
        return self.mechanism

    def affinity(self, allowed: set[int]) -> set[int]:
        """The CPUs a task limited to `cpus` CPUs by affinity runs on: the `slot`-th block of `cpus` of the
        allowed ones (wrapping round), all of them when there are no more than `cpus`."""
        cpus = sorted(allowed)
        if len(cpus) <= self.cpus:
            return set(cpus)
        start = (self.slot * self.cpus) % len(cpus)
        return {cpus[(start + i) % len(cpus)] for i in range(self.cpus)}

    def _write(self, path: str, value: str) -> None:
        with open(path, "w") as f:
            f.write(value)

    def _v2(self) -> bool:
        if not os.path.exists(os.path.join(self.root, "cgroup.controllers")):
            return False
        with open(os.path.join(self.root, "cgroup.controllers")) as f:
            have = f.read().split()
        if "memory" not in have or "pids" not in have:
            return False
        controllers = ["memory", "pids"] + (["cpu"] if self.cpus and "cpu" in have else [])
        parent = os.path.join(self.root, CGROUP_GROUP)
        os.makedirs(parent, exist_ok=True)
        for d in (self.root, parent):
            with open(os.path.join(d, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            if any(c not in enabled for c in controllers):
                self._write(os.path.join(d, "cgroup.subtree_control"), " ".join("+" + c for c in controllers))
        group = os.path.join(parent, self.name)
        os.mkdir(group)
        self.groups, self.memory_group, self.v2 = [group], group, True
        if "cpu" in controllers:
            self._write(os.path.join(group, "cpu.max"), f"{self.cpus * CPU_PERIOD_US} {CPU_PERIOD_US}")
            self.cpu_by = "cgroup"
        if self.mem_mb:
            self._write(os.path.join(group, "memory.max"), str(self.mem_mb << 20))
            with contextlib.suppress(OSError):
                self._write(os.path.join(group, "memory.swap.max"), "0")
        if self.max_procs:
            self._write(os.path.join(group, "pids.max"), str(self.max_procs))
        return True

    def _v1(self) -> bool:
        with open("/proc/self/cgroup") as f:
            own = own_cgroups(f.read())
        wanted = [c for c, on in (("memory", self.mem_mb), ("pids", self.max_procs)) if on]
        for c in wanted:
            if c not in own or not os.path.exists(os.path.join(self.root, c, "cgroup.procs")):
                return False
        if self.cpus and "cpu" in own and os.path.exists(os.path.join(self.root, "cpu", "cgroup.procs")):
            wanted.append("cpu")
        if not wanted:
            return False
        for c in wanted:
            group = os.path.join(self.root, c, own[c].lstrip("/"), CGROUP_GROUP + "-" + self.name)
            os.mkdir(group)
            self.groups.append(group)
            if c == "memory":
                self.memory_group = group
                limit = str(self.mem_mb << 20)
                self._write(os.path.join(group, "memory.limit_in_bytes"), limit)
                with contextlib.suppress(OSError):  # no swap accounting: swap stays possible
                    self._write(os.path.join(group, "memory.memsw.limit_in_bytes"), limit)
            elif c == "cpu":
                self._write(os.path.join(group, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                self._write(os.path.join(group, "cpu.cfs_quota_us"), str(self.cpus * CPU_PERIOD_US))
                self.cpu_by = "cgroup"
            else:
                self._write(os.path.join(group, "pids.max"), str(self.max_procs))
        return True

    def enter(self) -> None:
        """In the jail's process, before exec (so everything it starts is inside)."""
        import resource

        if self.tree_mb:
            # Inherited by bwrap and everything the job starts: a write or fallocate past it fails with EFBIG
            # (and SIGXFSZ), so one file never outgrows the tree limit whatever the watchdog's interval.
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.tree_mb << 20, self.tree_mb << 20))
        if self.cpu_by == "affinity":
            os.sched_setaffinity(0, self.affinity(os.sched_getaffinity(0)))
        if self.mechanism == "cgroup":
            for group in self.groups:
                self._write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
        elif self.mechanism == "rlimit":
            # RLIMIT_AS counts address space, not memory: a GPU runtime reserves far more than it uses, so a
            # task with GPUs gets no memory rlimit. RLIMIT_NPROC counts all of the user's processes, and root
            # ignores it (docs/operator.md says so).
            if self.mem_mb and not self.gpus:
                resource.setrlimit(resource.RLIMIT_AS, (self.mem_mb << 20, self.mem_mb << 20))
            if self.max_procs:
                resource.setrlimit(resource.RLIMIT_NPROC, (self.max_procs, self.max_procs))

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer killed something in the task's memory group."""
        if self.memory_group is None:
            return False
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            with open(os.path.join(self.memory_group, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                        return True
        except OSError:
            pass
        return False

    def finish(self) -> None:
        """Kill whatever is left in the task's groups (a process that left the jail's session) and remove them."""
        import time

        for _ in range(50):
            alive = False
            for group in self.groups:
                if self.v2 and os.path.exists(os.path.join(group, "cgroup.kill")):
                    with contextlib.suppress(OSError):
                        self._write(os.path.join(group, "cgroup.kill"), "1")
                try:
                    with open(os.path.join(group, "cgroup.procs")) as f:
                        pids = [int(x) for x in f.read().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    alive = True
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            if not alive:
                break
            time.sleep(0.05)
        self._remove()

    def _remove(self) -> None:
        for group in self.groups:
            with contextlib.suppress(OSError):
                os.rmdir(group)
        self.groups = []


def limits_mechanism(root: str = CGROUP_ROOT) -> str:
    """What would enforce a memory and process limit for a task started now ("cgroup" or "rlimit"): a trial
    group is created and removed."""
    probe = Limiter({"mem_mb": 64, "max_procs": 64}, f"probe-{os.getpid()}", root)
    try:
        return probe.setup()
    finally:
        probe.finish()


# --- artifacts ---------------------------------------------------------------------------------------------


def valid_artifact(rel: str) -> str | None:
    """Why the declared artifact path is refused, or None."""
    if not rel or rel.startswith("/") or rel.startswith("~") or "\\" in rel or "\0" in rel:
        return "not a relative path"
    if any(p in ("", ".", "..") for p in rel.split("/")):
        return "has an empty, '.' or '..' component"
    return None


def open_contained(tree: str, rel: str) -> int:
    """Open `tree/rel` for reading without following any symlink below `tree`."""
    fd = os.open(tree, _O_DIR)
    try:
        parts = rel.split("/")
        for part in parts[:-1]:
            nfd = os.open(part, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def copy_artifacts(
    tree: str, declared: list[str], out_dir: str, log_path: str, max_bytes: int, max_total: int
) -> list[dict[str, Any]]:
    """Copy each declared artifact out of the (no longer running) job's tree; log one JSON line per artifact.
    Raises OSError (ENOSPC) once the log is written when an artifact could not be stored for a full disk."""
    import hashlib

    records: list[dict[str, Any]] = []
    total = 0
    no_room = False  # an artifact met a full disk: raised after the log (ENOSPC), so the task says so
    real_tree = os.path.realpath(tree)
    for rel in declared:
        rec: dict[str, Any] = {"path": rel}
        reason = valid_artifact(rel)
        if reason is None:
            target = os.path.realpath(os.path.join(real_tree, rel))
            if not target.startswith(real_tree + os.sep):
                reason = "resolves outside the job's tree (symlink escape)"
        if reason is None:
            try:
                fd = open_contained(real_tree, os.path.relpath(target, real_tree))
            except FileNotFoundError:
                reason = "not found in the job's tree"
            except OSError as e:
                reason = f"cannot be opened inside the tree: {e.strerror}"
        if reason is None:
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    reason = (
                        "is a directory; artifacts are single files: name each file, or archive the "
                        "directory in your command (tar czf out.tgz DIR) and name the archive"
                    )
                elif not stat.S_ISREG(st.st_mode):
                    reason = "not a regular file"
                else:
                    limit = min(max_bytes, max_total - total)
                    h = hashlib.sha256()
                    chunks = []
                    size = 0
                    while True:
                        chunk = os.read(fd, 1 << 20)
                        if not chunk:
                            break
                        size += len(chunk)
                        if size > limit:
                            break
                        h.update(chunk)
                        chunks.append(chunk)
                    if size > limit:
                        if limit < max_bytes:
                            reason = f"would exceed the total artifact cap of {max_total} bytes"
                        else:
                            reason = f"larger than the artifact cap of {max_bytes} bytes"
                    else:
                        dest_dir = os.path.join(out_dir, os.path.dirname(rel))
                        try:
                            os.makedirs(dest_dir, exist_ok=True)
                            write_atomic(dest_dir, os.path.basename(rel), b"".join(chunks))
                        except OSError as e:  # e.g. "a" and "a/b" both declared
                            reason = f"could not be stored: {e.strerror}"
                            no_room = no_room or is_disk_full(e)
                        else:
                            total += size
                            rec.update(status="copied", size=size, sha256=h.hexdigest())
            finally:
                os.close(fd)
        if reason is not None:
            rec.update(status="skipped", reason=reason)
        records.append(rec)
    if not declared:  # nothing to account for: no file (which a full disk may not have room for)
        return records
    with open(log_path, "w") as log:
        for rec in records:
            log.write(json.dumps(rec, sort_keys=True) + "\n")
    if no_room:
        raise OSError(errno.ENOSPC, "an artifact could not be stored: the run directory's disk is full")
    return records


def remove_tree(path: str) -> None:
    import shutil

    def fix(func: Any, p: str, exc: Any) -> None:
        # A job may leave directories without write or search permission; restore them and retry.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=fix)  # onerror is deprecated from 3.12 on
        else:
            shutil.rmtree(path, onerror=fix)
    except RecursionError:  # shutil recurses once a level: a job's chain of ~1000 directories
        remove_deep(path)


def remove_scratch(paths: list[str], *, detach: bool) -> None:
    """Remove the task's scratch directories, once its exit-code is written. With `detach` (the local backend,
    whose slot is this process: it is free when this process is gone) a forked child in a session of its own
    removes them and this process leaves at once; not where another thread still runs (a copier held by an
    escaped process, a kill timer), which a fork would not carry, nor under a scheduler that ends whatever a
    job leaves behind when its script exits (Slurm): there they are removed here, before the exit."""
    if not paths:
        return
    if detach:
        import threading

        if threading.active_count() == 1:
            try:
                pid = os.fork()
            except OSError:
                pid = -1
            if pid == 0:
                try:
                    os.setsid()
                    for path in paths:
                        remove_tree(path)
                finally:
                    os._exit(0)
            if pid > 0:
                return
    for path in paths:
        remove_tree(path)


def remove_deep(path: str) -> None:
    """Remove the tree at `path` without recursion or path lengths: depth-first through directory fds, each
    directory's permissions restored before it is entered; one that cannot be emptied is left (and skipped)."""
    stuck: set[tuple[int, int]] = set()
    fds, names = [os.open(path, _O_DIR)], [""]
    try:
        while fds:
            fd, child = fds[-1], None
            for entry in os.scandir(fd):
                if entry.is_dir(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) in stuck:
                        continue
                    with contextlib.suppress(OSError):
                        os.chmod(entry.name, 0o700, dir_fd=fd, follow_symlinks=False)
                    try:
                        child = os.open(entry.name, _O_DIR, dir_fd=fd)
                    except OSError:
                        stuck.add((st.st_dev, st.st_ino))
                        continue
                    names.append(entry.name)
                    break
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                fds.append(child)
                continue
            st = os.fstat(fd)
            os.close(fds.pop())
            name = names.pop()
            if fds:
                try:
                    os.rmdir(name, dir_fd=fds[-1])
                except OSError:
                    stuck.add((st.st_dev, st.st_ino))
    finally:
        for fd in fds:
            os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)


# --- running -----------------------------------------------------------------------------------------------


class Runner:
    """Runs the jail; turns scheduler/cancel signals into a recorded reason and a kill of the jail."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.reason: str | None = None
        self.signal_name: str | None = None
        self.limited: tuple[str, str] | None = None  # (kind, message) of a limit that stopped the jail
        self.proc: subprocess.Popen[bytes] | None = None

    def stopped_for(self) -> str | None:
        return self.reason

    def limit(self, kind: str, message: str) -> None:
        """Stop the jail for a limit it reached (KIND_DISK_FULL, KIND_DISK_LIMIT); the first one is kept (any
        thread)."""
        if self.limited is None:
            self.limited = (kind, message)
        self._stop()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.reason != KIND_TIMEOUT:  # a walltime warning stays the reason even if a TERM follows
            self.reason = KIND_TIMEOUT if signum == signal.SIGUSR2 else KIND_TERMINATED
            self.signal_name = signal.Signals(signum).name
        self._stop()

    def _stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        import threading  # loaded by preload() before any jail runs: no first import in a signal handler

        timer = threading.Timer(self.grace, self._kill, (proc.pid,))
        timer.daemon = True
        timer.start()

    def _disk_full(self, written: int) -> None:
        self.limit(
            KIND_DISK_FULL,
            "the run directory's disk is full: the job's output could not be stored past "
            f"{written} bytes of one stream, so the job was stopped",
        )

    @staticmethod
    def _kill(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    def run(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        stdout: int,
        stderr: int,
        cap: int,
        preexec: Any = None,
        pass_fds: tuple[int, ...] = (),
    ) -> int:
        """Run the jail with its output copied into `stdout`/`stderr`, each capped at `cap` bytes; `preexec`
        runs in the child before the exec (Limiter.enter); `pass_fds` are inherited by it."""
        import subprocess
        import threading

        pipes = [os.pipe(), os.pipe()]
        try:
            # bwrap's --die-with-parent is tied to the thread that forked it: this (main) thread lives to the end.
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=pipes[0][1],
                stderr=pipes[1][1],
                start_new_session=True,
                preexec_fn=preexec,
                pass_fds=pass_fds,
            )
        except BaseException:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            raise
        copiers = []
        for (r, w), dest in ((pipes[0], stdout), (pipes[1], stderr)):
            os.close(w)
            t = threading.Thread(target=drain, args=(r, dest, cap, self._disk_full), daemon=True)
            t.start()
            copiers.append(t)
        if self.reason is not None:
            self._stop()
        status = self.proc.wait()
        for t in copiers:
            # An escaped process still holding the pipe must not keep the wrapper from finishing.
            t.join(self.grace)
        return status


def drain(src: int, dest: int, cap: int, full: Any = None) -> None:
    """Copy `src` into `dest` up to `cap` bytes, then keep reading (so the job never blocks) and count. When
    `dest`'s disk is full (ENOSPC, EDQUOT) nothing more is written and `full(bytes written)` is called once."""
    written = dropped = 0
    no_room = False
    try:
        while True:
            chunk = os.read(src, 1 << 16)
            if not chunk:
                break
            room = 0 if no_room else cap - written
            if room > 0:
                part = chunk[:room]
                try:
                    write_all(dest, part)
                except OSError as e:
                    if not is_disk_full(e):
                        raise
                    no_room = True
                    if full is not None:
                        full(written)
                else:
                    written += len(part)
                    chunk = chunk[len(part) :]
            dropped += len(chunk)
        if dropped and not no_room:
            note = f"\n[syscall-wrapper] output truncated: {dropped} bytes beyond the cap of {cap} were dropped\n"
            with contextlib.suppress(
                OSError
            ):  # the disk may fill up in between: the note is all that is lost
                write_all(dest, note.encode())
    finally:
        os.close(src)


# Every inode counts at least one block: a flood of empty files is bounded by the limit too.
MIN_FILE_BYTES = 4096


class DiskUse:
    """One sum of what a job holds on disk: the files below its directories (walked through directory fds
    without following a symlink) and the deleted files its processes still hold open (through /proc/PID/fd),
    each inode once, each at least MIN_FILE_BYTES; what vanishes while it is summed is not counted. What cannot
    be read otherwise (a directory the job made unreadable, one too deep for the wrapper's descriptors) would
    hide what is below it: `unmeasured` says so, and the job is stopped for it."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self.total = 0
        self.largest = 0  # the largest regular file's size
        self.unmeasured: OSError | None = None

    def _error(self, e: OSError) -> None:
        # ENOENT, ENOTDIR: an entry gone or replaced while it was walked; what replaced it is seen next time
        if e.errno not in (errno.ENOENT, errno.ENOTDIR) and self.unmeasured is None:
            self.unmeasured = e

    def add(self, st: os.stat_result) -> None:
        if (st.st_dev, st.st_ino) in self.seen:
            return
        self.seen.add((st.st_dev, st.st_ino))
        self.total += max(st.st_blocks * 512, MIN_FILE_BYTES)
        if stat.S_ISREG(st.st_mode):
            self.largest = max(self.largest, st.st_size)

    def walk(self, top: str) -> None:
        try:
            for _root, dirs, files, dfd in os.fwalk(top, follow_symlinks=False, onerror=self._error):
                for name in dirs + files:
                    try:
                        self.add(os.stat(name, dir_fd=dfd, follow_symlinks=False))
                    except OSError as e:
                        self._error(e)
        except OSError as e:
            self._error(e)
        except RecursionError:  # os.fwalk recurses once a level: a chain of ~1000 directories
            self._error(OSError(errno.ELOOP, "nested too deep to measure", top))

    def open_deleted(self, pid: int) -> None:
        """The deleted regular files `pid` and its descendants hold open (unlinked, so no walk finds them)."""
        for p in descendants(pid):
            try:
                fds = os.listdir(f"/proc/{p}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    st = os.stat(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 0:
                    self.add(st)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (/proc/PID/task/TID/children), as far as they can be read."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{p}/task/{tid}/children") as f:
                todo += [int(x) for x in f.read().split()]
    return out


class TreeWatch:
    """Sums what the job holds on disk (DiskUse: its writable directories, and the deleted files its processes
    hold open) every TREE_WATCH_MIN_S..TREE_WATCH_MAX_S seconds and calls `over(used)` once when it is past
    `limit` bytes (the job is then stopped: it may have written what it can write in one interval beyond the
    limit). One big file is refused at once, by RLIMIT_FSIZE (Limiter). `pid()` is the jail's pid, or None
    before it started."""

    def __init__(self, dirs: list[str], limit: int, over: Any, pid: Any = None) -> None:
        import threading

        self.dirs, self.limit, self.over, self.pid = dirs, limit, over, pid
        self.peak = self.largest = 0
        self.unmeasured: OSError | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def used(self) -> int:
        """The bytes the job holds now; -1 when part of its tree could not be read (`unmeasured`)."""
        use = DiskUse()
        for d in self.dirs:
            use.walk(d)
        pid = None if self.pid is None else self.pid()
        if pid is not None:
            use.open_deleted(pid)
        self.peak = max(self.peak, use.total)
        self.largest = max(self.largest, use.largest)
        self.unmeasured = use.unmeasured
        return -1 if use.unmeasured is not None else use.total

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        import time

        interval = TREE_WATCH_MIN_S
        while not self._done.wait(interval):
            began = time.monotonic()
            used = self.used()
            if used < 0 or used > self.limit:
                self.over(used)
                return
            took = time.monotonic() - began
            interval = max(TREE_WATCH_MIN_S, min(TREE_WATCH_MAX_S, 10 * took), took)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def run_score(
    score: dict[str, Any],
    config: dict[str, Any],
    index: int,
    scratch: str,
    tree: str,
    tdir: str,
    runner: Runner,
    note: Any,
) -> tuple[int | None, dict[str, Any]]:
    """The operator's score stage for this side, in its own jail; returns its exit status (128+N for a signal),
    None when it could not start, and what exit-code says about the scorer's copy of the tree (`score_unseen`:
    the paths it did not see and why, the first UNSEEN_KEPT; `score_unseen_count`). Its stdout and stderr go
    to score-stdout / score-stderr of the task dir, which the agent never sees whole (the kernel reads the
    metric from score-stdout).

    The score stage reads a copy of the tree (copy_for_scorer), never `tree` itself: only regular files and
    directories, so no symlink the candidate left (to `/proc/self/fd/N`, which would be the scorer's own open
    labels, or to the data's path) and no FIFO or device is there to open."""
    home, scorer, view = (os.path.join(scratch, n) for n in ("score-home", "scorer", "score-tree"))
    for d in (home, scorer, view):
        os.mkdir(d, 0o700)
    seen: dict[str, Any] = {}
    if score.get("scorer") is not None:  # score_from = "base": the scorer is the base commit's tree
        try:
            materialise(dict(config["git"], protected=None, **score["scorer"]), scorer, scratch)
        except WrapperError as e:
            note(f"the scorer (the base commit) could not be written: {e}")
            return None, seen
    try:
        unseen, count = copy_for_scorer(tree, view, lambda: runner.reason is not None)
    except OSError as e:
        note(f"the copy of the tree for the scorer could not be made: {e}")
        return None, seen
    if count:
        seen = {"score_unseen": unseen, "score_unseen_count": count}
    tree = view
    import secrets

    # The private data is mounted at a path drawn now, after `command` has exited: the candidate cannot know it
    # (and its symlinks are not in the copy the scorer reads anyway).
    data_at = "/score-data-" + secrets.token_hex(16)
    env = fill_env(dict(score["env"]), tree=tree, home=home, scorer=scorer, data=data_at)
    seeds = config.get("seeds") or []
    if seeds:
        env["EVAL_SEED"] = str(seeds[index % len(seeds)])
    kind = score["kind"]
    argv = render_argv(
        score["argv"],
        kind,
        tree,
        home,
        os.path.join(scratch, "work"),
        env,
        score["command"],
        scorer,
        score_data=data_at,
    )
    argv[0] = jail_program(argv[0], os.environ.get("PATH"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    out_fd = os.open(os.path.join(tdir, "score-stdout"), flags, 0o644)
    err_fd = os.open(os.path.join(tdir, "score-stderr"), flags, 0o644)
    try:
        if runner.reason is not None:
            return None, seen
        status = runner.run(argv, scorer, env, out_fd, err_fd, int(config.get("output_max_bytes", 64 << 20)))
    except OSError as e:
        note(f"the score jail could not be started: {e}")
        return None, seen
    finally:
        os.close(out_fd)
        os.close(err_fd)
    return (status if status >= 0 else 128 - status), seen


# The paths the scorer did not see that exit-code names (all of them are counted).
UNSEEN_KEPT = 50


def _kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "not a regular file or a directory"


def _data_runs(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the parts of a file holding data (SEEK_DATA/SEEK_HOLE; the whole file where the
    filesystem cannot say): a sparse file's holes cost its copy nothing."""
    import errno

    runs: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole from here on
                    break
                raise
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            runs.append((start, min(pos, size)))
    except (OSError, AttributeError):
        return [(0, size)] if size else []
    return runs


def _copy_data(src: int, dst: int, size: int) -> None:
    """Copy the first `size` bytes of `src` into the empty file `dst`, holes kept as holes."""
    copy_range = getattr(os, "copy_file_range", None)  # Linux, Python 3.8+
    for start, end in _data_runs(src, size):
        pos = start
        while pos < end:
            n = 0
            if copy_range is not None:
                try:
                    n = copy_range(src, dst, min(end - pos, 1 << 30), pos, pos)
                except OSError:  # another filesystem, or not supported: read and write from here on
                    copy_range = None
                    continue
            else:
                chunk = os.pread(src, min(end - pos, 1 << 20), pos)
                n = len(chunk)
                done = 0
                while done < n:
                    done += os.pwrite(dst, chunk[done:], pos + done)
            if n == 0:  # the file is shorter than it was when listed
                break
            pos += n
    os.ftruncate(dst, size)


def copy_for_scorer(
    tree: str, dest: str, stopped: Callable[[], bool] = lambda: False
) -> tuple[list[dict[str, str]], int]:
    """Copy the (no longer running) job's `tree` into the empty directory `dest` for the score stage: regular
    files (their bytes, mode 0644 or 0755) and directories only. Symlinks, FIFOs, sockets, device nodes, files
    hard-linked to a file outside the tree and whatever cannot be read are left out; returns the first
    UNSEEN_KEPT of them as {"path", "why"} and how many there were. Every component is opened through directory
    fds with O_NOFOLLOW (nothing is followed) and at most two DirChains of fds are held, whatever the tree.
    InterruptedError when `stopped()` (the task was cancelled or ran out of time) before it is done."""
    unseen: list[dict[str, str]] = []
    count = 0

    def skip(rel: list[str], why: str) -> None:
        nonlocal count
        count += 1
        if len(unseen) < UNSEEN_KEPT:
            shown = os.fsencode("/".join(rel)).decode("utf-8", "backslashreplace") or "."
            unseen.append({"path": shown if len(shown) <= 300 else shown[:300] + "...", "why": why})

    src = DirChain(os.open(tree, _O_DIR), create=False)
    dst = DirChain(os.open(dest, _O_DIR), create=True)
    linked: dict[tuple[int, int], list[list[str]]] = {}  # a file with more than one name: its names here
    nlinks: dict[tuple[int, int], int] = {}
    stack: list[list[str]] = [[]]
    try:
        while stack:
            if stopped():
                raise InterruptedError("stopped while copying the tree for the scorer")
            parts = stack.pop()
            try:
                sfd = src.at(parts)
                names = sorted(os.listdir(sfd))
            except OSError as e:
                skip(parts, f"a directory that cannot be read ({e.strerror})")
                continue
            subdirs = []
            for name in names:
                rel = [*parts, name]
                try:
                    st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        subdirs.append(rel)
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        skip(rel, _kind_of(st.st_mode))
                        continue
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
                except OSError as e:
                    skip(rel, f"cannot be read ({e.strerror})")
                    continue
                try:
                    got = os.fstat(fd)
                    if not stat.S_ISREG(got.st_mode) or (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                        skip(rel, "changed while it was being copied")
                        continue
                    if got.st_nlink > 1:
                        linked.setdefault((got.st_dev, got.st_ino), []).append(rel)
                        nlinks[(got.st_dev, got.st_ino)] = got.st_nlink
                    perm = 0o755 if got.st_mode & 0o111 else 0o644
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                    out = os.open(name, flags, perm, dir_fd=dst.at(parts))
                    try:
                        _copy_data(fd, out, got.st_size)
                    finally:
                        os.close(out)
                finally:
                    os.close(fd)
            dst.at(parts)  # an empty directory too
            stack.extend(reversed(subdirs))
        for key, rels in linked.items():
            if len(rels) < nlinks[key]:  # another name of this file lies outside the tree
                for rel in rels:
                    os.unlink(rel[-1], dir_fd=dst.at(rel[:-1]))
                    skip(rel, "a hard link to a file outside the tree")
    finally:
        for chain in (src, dst):
            chain.close()
            os.close(chain.root)
    return unseen, count


# fallocate(2) by architecture (audit arch -> syscall numbers, x32's with its bit): refused in a jail with a tree
# limit, since it can reserve gigabytes per call faster than any watchdog sums them.
FALLOCATE_SYSCALLS = {
    0xC000003E: (285, 0x40000000 | 285),  # x86_64 (and x32)
    0x40000003: (324,),  # i386
    0xC00000B7: (47,),  # aarch64
    0x40000028: (352,),  # arm
    0xC0000015: (309,),  # ppc64le
    0x80000016: (314,),  # s390x
}


def no_fallocate_filter(errno_value: int = errno.EOPNOTSUPP) -> bytes:
    """A classic-BPF seccomp program (bwrap --seccomp) that makes fallocate(2) fail with `errno_value` and lets
    every other call through. A program using it falls back to writing (glibc's posix_fallocate does), which
    the tree watchdog sees at the disk's write rate."""
    import struct

    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, deny = 0x7FFF0000, 0x00050000 | errno_value  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    # (code, jt, jf, k) with "DENY" as a jump target resolved below; seccomp_data: nr at 0, arch at 4.
    prog: list[tuple[int, Any, int, int]] = []
    for arch, numbers in FALLOCATE_SYSCALLS.items():
        prog.append((ld, 0, 0, 4))
        prog.append((jeq, 0, len(numbers) + 2, arch))  # another arch: on to the next block
        prog.append((ld, 0, 0, 0))
        prog += [(jeq, "DENY", 0, n) for n in numbers]
        prog.append((ret, 0, 0, allow))
    prog.append((ret, 0, 0, allow))
    deny_at = len(prog)
    prog.append((ret, 0, 0, deny))
    out = b""
    for pc, (code, jt, jf, k) in enumerate(prog):
        out += struct.pack("=HBBI", code, deny_at - pc - 1 if jt == "DENY" else jt, jf, k)
    return out


def seccomp_fd(program: bytes) -> int:
    """A readable fd holding `program` from its start (bwrap reads it whole), inherited by the jail's start."""
    r, w = os.pipe()
    try:
        write_all(w, program)  # a few hundred bytes: below the pipe's buffer
    finally:
        os.close(w)
    return r


def tree_watch(tree_mb: int, dirs: list[str], runner: Runner) -> TreeWatch | None:
    """The watchdog of a task with a tree limit: over it, the jail is stopped with KIND_DISK_LIMIT."""
    if not tree_mb:
        return None

    def over(used: int) -> None:
        runner.limit(KIND_DISK_LIMIT, tree_message(tree_mb, used, watch.unmeasured))

    def jail_pid() -> int | None:
        proc = runner.proc
        return None if proc is None or proc.returncode is not None else proc.pid

    watch = TreeWatch(dirs, tree_mb << 20, over, jail_pid)
    return watch


def tree_message(tree_mb: int, used: int, unmeasured: OSError | None = None) -> str:
    if unmeasured is not None:
        return (
            f"the job's tree could not be measured against its {tree_mb} MiB disk limit, so the job was stopped: "
            f"{unmeasured.strerror} ({os.path.basename(unmeasured.filename or '') or 'a directory'}): a "
            "directory the job made unreadable, or nested too deep"
        )
    return (
        f"the job's tree exceeded its {tree_mb} MiB disk limit (its tree, home and work directories held "
        f"{used >> 20} MiB when it was stopped)"
    )


def tree_verdict(watch: TreeWatch | None, tree_mb: int, cmd_code: int) -> tuple[str, str] | None:
    """After the jail: the tree limit's end when the watchdog missed it (the job ended within one interval of
    passing it), or when a failed command had a file stopped at the limit by RLIMIT_FSIZE (killed by SIGXFSZ,
    the shell's 128+25, or a write refused with EFBIG: the file is within a block of the limit)."""
    if watch is None:
        return None
    used = watch.used()
    if used < 0 or used > tree_mb << 20:
        return KIND_DISK_LIMIT, tree_message(tree_mb, used, watch.unmeasured)
    at_limit = watch.largest >= (tree_mb << 20) - FSIZE_SLACK
    if cmd_code == 128 + signal.SIGXFSZ or (cmd_code != 0 and at_limit):
        return KIND_DISK_LIMIT, (
            f"the job's tree exceeded its {tree_mb} MiB disk limit: a file it wrote reached {tree_mb} MiB, "
            "the most one file may hold, and the write past it was refused (EFBIG, SIGXFSZ)"
        )
    return None


def disk_full_record(detail: str, cmd_code: int) -> dict[str, Any]:
    return exit_record(KIND_DISK_FULL, EXIT_DISK_FULL, command_code=cmd_code, detail=detail)


def exit_record(kind: str, code: int, **extra: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"code": code, "kind": kind}
    rec.update(extra)
    return rec


def preload() -> None:
    """Import what the rest of a task needs, once `started` is written (see the imports at the top)."""
    import importlib

    for name in ("subprocess", "threading", "tempfile", "shutil", "hashlib", "traceback"):
        importlib.import_module(name)


def main_task(
    config: dict[str, Any], environ: dict[str, str], runner: Runner, leftover: list[str]
) -> tuple[str, dict[str, Any]]:
    """Run one task; returns (task dir, exit record), with the task's scratch directory appended to `leftover`
    (removed by the caller once exit-code is written). Raises WrapperError only before the task dir is known."""
    launch_dir = config["launch_dir"]
    array = int(config["array"])
    index = task_index(array, environ)
    tdir = task_dir_for(launch_dir, index, array)
    os.makedirs(tdir, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):  # a rerun (requeue) must not look finished
        os.unlink(os.path.join(tdir, "exit-code"))
    logs: list[int] = []
    try:
        reserve_record(tdir)
        write_atomic(tdir, "started", (now_rfc3339() + "\n").encode())
        for name in ("stdout", "stderr"):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            logs.append(os.open(os.path.join(tdir, name), flags, 0o644))
    except OSError as e:
        for fd in logs:
            os.close(fd)
        if not is_disk_full(e):
            raise
        sys.stderr.write(f"syscall job wrapper: the run directory's disk is full: {e}\n")
        detail = "the run directory's disk is full: the task could not be started"
        return tdir, exit_record(KIND_DISK_FULL, EXIT_DISK_FULL, detail=detail)
    preload()
    out_fd, err_fd = logs

    def note(text: str) -> None:
        with contextlib.suppress(OSError):  # a full disk: the exit record (reserved) still says what happened
            write_all(err_fd, (f"[syscall-wrapper] {text}\n").encode("utf-8", "replace"))

    def stamp_ended() -> None:
        with contextlib.suppress(OSError):  # without it, the kernel takes the exit record's time
            write_atomic(tdir, "ended", (now_rfc3339() + "\n").encode())

    try:
        with open(os.path.join(launch_dir, "command.txt"), "rb") as f:
            command = f.read().decode("utf-8", "replace")
        if not command.strip():
            note("command.txt is empty: nothing to run")
            return tdir, exit_record(KIND_EMPTY, EXIT_EMPTY_COMMAND)
        base = config.get("scratch") or environ.get("TMPDIR") or "/tmp"
        import tempfile

        scratch = tempfile.mkdtemp(prefix="syscall-job-", dir=base)
        leftover.append(scratch)
        tree, home, work = (os.path.join(scratch, n) for n in ("tree", "home", "work"))
        for d in (tree, home, work):
            os.mkdir(d, 0o700)
        try:
            materialise(config["git"], tree, scratch)
        except WrapperError as e:
            note(str(e))
            stopped = runner.stopped_for()
            if stopped is not None:  # the signal also hit git, which is why materialising failed
                code = EXIT_TIMEOUT if stopped == KIND_TIMEOUT else EXIT_TERMINATED
                return tdir, exit_record(stopped, code, signal=runner.signal_name)
            return tdir, exit_record(e.kind, e.code)
        if runner.reason is not None:
            note(f"stopped by {runner.signal_name} before the command started")
            code = EXIT_TIMEOUT if runner.reason == KIND_TIMEOUT else EXIT_TERMINATED
            return tdir, exit_record(runner.reason, code, signal=runner.signal_name)
        venv = venv_source = ""
        kind = config["jail"]["kind"]
        environment = config.get("environment")
        if environment:
            # The warm cache's own venv, read-only, shared by every task: nothing is built per task. A bwrap or
            # apptainer jail binds it at `mount` (where bwrap built it; relocatable otherwise); with none the job
            # uses it where it is.
            venv_source = environment.get("venv") or ""
            if not venv_source:
                note("the locked environment names no venv (a cache entry from before venvs were shared)")
                return tdir, exit_record(KIND_ENVIRONMENT, EXIT_ENVIRONMENT_FAILED)
            venv = environment["mount"] if kind in ("bwrap", "apptainer") else venv_source
        env = job_env(config, index, home, environ, venv)
        gpu = config.get("gpu") or {}
        gpus = None
        if int(gpu.get("count", 0)) > 0:
            gpus = gpu_bind_args(
                environ.get("CUDA_VISIBLE_DEVICES"), dev_listing(), bool(gpu.get("constrained"))
            )
        argv = render_argv(
            config["jail"]["argv"],
            kind,
            tree,
            home,
            work,
            env,
            command,
            venv=venv,
            gpus=gpus,
            venv_source=venv_source,
        )
        argv[0] = jail_program(argv[0], environ.get("PATH"))
        import subprocess

        limits = dict(config.get("limits") or {}, gpus=gpu.get("count", 0), slot=index)
        limiter = Limiter(limits, "{}-{}-{}".format(str(config["key"]).replace("/", "-"), index, os.getpid()))
        watch = tree_watch(limiter.tree_mb, [tree, home, work], runner)
        filter_fd = None
        if watch is not None and kind == "bwrap":
            filter_fd = seccomp_fd(no_fallocate_filter())
            argv[1:1] = ["--seccomp", str(filter_fd)]
        try:
            limiter.setup()
            if watch is not None:
                watch.start()
            status = runner.run(
                argv,
                tree,
                env,
                out_fd,
                err_fd,
                int(config.get("output_max_bytes", 64 << 20)),
                limiter.enter if limiter.wanted else None,
                () if filter_fd is None else (filter_fd,),
            )
        except (OSError, subprocess.SubprocessError) as e:
            note(f"the jail could not be started: {e}")
            limiter.finish()
            return tdir, exit_record(KIND_WRAPPER, EXIT_WRAPPER_ERROR)
        finally:
            if watch is not None:
                watch.stop()
            if filter_fd is not None:
                os.close(filter_fd)
        oom = limiter.oom_killed()
        limiter.finish()
        stamp_ended()
        cmd_code = status if status >= 0 else 128 - status
        reason = runner.stopped_for()  # a signal handler may have set it while the jail ran
        limited = runner.limited or tree_verdict(watch, limiter.tree_mb, cmd_code)
        if limited is not None and reason is None:
            note(limited[1])
            code = EXIT_DISK_FULL if limited[0] == KIND_DISK_FULL else EXIT_DISK_LIMIT
            rec = exit_record(limited[0], code, command_code=cmd_code, detail=limited[1])
        elif oom and reason is None:
            note(f"the task went over its memory limit of {limiter.mem_mb} MB and was killed")
            rec = exit_record(KIND_OOM, cmd_code, command_code=cmd_code)
        elif reason is not None:
            code = EXIT_TIMEOUT if reason == KIND_TIMEOUT else EXIT_TERMINATED
            rec = exit_record(reason, code, signal=runner.signal_name, command_code=cmd_code)
        elif status < 0:
            rec = exit_record(KIND_SIGNALED, cmd_code, signal=signal.Signals(-status).name)
        else:
            rec = exit_record(KIND_EXITED, status)
        score = config.get("score")
        if score is not None and rec["kind"] == KIND_EXITED and rec["code"] == 0:
            # Every process of `command` is gone by now: its jail's pid namespace died with it (bwrap
            # --unshare-pid), so nothing it left behind can print into the score's output or touch the tree.
            rec["score_code"], seen = run_score(score, config, index, scratch, tree, tdir, runner, note)
            rec.update(seen)
            stamp_ended()
            reason = runner.stopped_for()
            if reason is not None:
                code = EXIT_TIMEOUT if reason == KIND_TIMEOUT else EXIT_TERMINATED
                rec = exit_record(reason, code, signal=runner.signal_name, command_code=cmd_code)
            elif runner.limited is not None:  # the score's output met a full disk: its result is not whole
                rec = disk_full_record(runner.limited[1], cmd_code)
        try:
            copy_artifacts(
                tree,
                list(config["artifacts"]),
                os.path.join(tdir, "artifacts"),
                os.path.join(tdir, "artifacts.log"),
                int(config["artifact_max_bytes"]),
                int(config["artifact_total_max_bytes"]),
            )
        except OSError as e:
            note(f"copying artifacts failed: {e}")
            if is_disk_full(e) and rec["kind"] == KIND_EXITED and rec["code"] == 0:
                # A success whose artifacts were not stored is not one: the agent would look for them.
                detail = "the run directory's disk is full: the job's artifacts could not be stored"
                rec = disk_full_record(detail, cmd_code)
        return tdir, rec
    except Exception:  # a wrapper bug must still leave an exit-code that says so
        import traceback

        note("internal error:\n" + traceback.format_exc())
        return tdir, exit_record(KIND_WRAPPER, EXIT_WRAPPER_ERROR)
    finally:
        os.close(out_fd)
        os.close(err_fd)


def main() -> int:
    config = json.loads(CONFIG_JSON) if CONFIG_JSON else None
    if config is None:
        sys.stderr.write(
            "syscall job wrapper: no configuration embedded (render it with kernel.backends.jobscript)\n"
        )
        return EXIT_WRAPPER_ERROR
    runner = Runner(float(config.get("kill_grace_s", 5.0)))
    runner.install()
    environ = dict(os.environ)
    leftover: list[str] = []
    try:
        try:
            tdir, rec = main_task(config, environ, runner, leftover)
        except WrapperError as e:
            sys.stderr.write(f"syscall job wrapper: {e}\n")
            return e.code
        rec["finished_at"] = now_rfc3339()
        rec["host"] = os.uname().nodename
        try:
            write_record(tdir, "exit-code", (json.dumps(rec, sort_keys=True) + "\n").encode())
        except OSError as e:  # no reserve and no room: the backend records the end (kernel.backends.local)
            sys.stderr.write(f"syscall job wrapper: the exit record could not be written: {e}\n")
            return EXIT_DISK_FULL if is_disk_full(e) else EXIT_WRAPPER_ERROR
        return int(rec["code"])
    finally:
        # After exit-code: the task's end is on record before its scratch (the tree, home, work) goes.
        remove_scratch(leftover, detach=environ.get(DETACH_VAR) == "1")


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # exit-code is on disk: leave at once (interpreter teardown only delays the backend's notice).
    os._exit(rc)
