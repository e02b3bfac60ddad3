"""Snapshot a workspace's current content as a git commit the kernel holds under its own ref.

The snapshot is what a sleep's jobs run and what a submit evaluates (its tree id is compared). It captures the
working tree as it is on disk, dirty and untracked-but-not-ignored files included, `.syscall/` never included,
as a commit parented on HEAD (a root commit when HEAD has none) under `refs/syscall/<workspace-key>/<seq>`.

The workspace is hostile (threat-model.md). So:
- git never runs anything the workspace chose: hooks, fsmonitor, ssh, credential helpers, pagers, gpg and filter
  drivers are overridden through `GIT_CONFIG_COUNT/KEY/VALUE` (command scope, which beats the repo's config, and
  is not visible in `ps` like `-c` would be); global and system config are `/dev/null`; there is no HOME.
- git only LISTS files: HEAD's tree (`ls-tree`) and, against a temporary empty index (`GIT_INDEX_FILE` in a
  kernel-owned temp dir, so the workspace's own index is neither trusted nor touched), every file not ignored
  (`ls-files --others`). The kernel reads every file itself, walking directory fds with `O_NOFOLLOW`, so a
  directory swapped for a symlink mid-snapshot cannot make it read outside the workspace, and the content goes
  to `git fast-import` byte for byte: unlike `git add`, no clean filter and no eol conversion, whatever the
  attributes or config say, even if the agent edits them while the snapshot runs.
- `.git` must be a real directory; alternates, `commondir` and config includes (which make git read outside the
  workspace) are refused with a clear error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.to_thread

from channel.paths import CHANNEL_DIR

SAFE_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
REF_PREFIX: Final = "refs/syscall"
COMMITTER: Final = "syscall-kernel <kernel@syscall.invalid>"
DEFAULT_MAX_FILE_BYTES: Final = 256 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES: Final = 2 * 1024 * 1024 * 1024

# Config the workspace may set that makes git run a program or read outside the repository; every git the
# kernel (or the job wrapper) runs gets these values in command scope.
NEUTRAL_CONFIG: Final[tuple[tuple[str, str], ...]] = (
    ("core.hooksPath", "/dev/null"),
    ("core.fsmonitor", "false"),
    ("core.untrackedCache", "false"),
    ("core.splitIndex", "false"),
    ("core.sshCommand", "false"),
    ("core.askPass", ""),
    ("core.pager", "cat"),
    ("core.editor", "false"),
    ("core.excludesFile", "/dev/null"),
    ("core.attributesFile", "/dev/null"),
    ("core.symlinks", "true"),
    ("credential.helper", ""),
    ("protocol.allow", "never"),
    ("commit.gpgSign", "false"),
    ("gpg.program", "false"),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
    ("fetch.fsckObjects", "false"),
    ("diff.external", ""),
    ("uploadpack.packObjectsHook", ""),
)
FILTER_KEYS: Final = (("clean", "cat"), ("smudge", "cat"), ("process", ""), ("required", "false"))


class SnapshotError(Exception):
    """The workspace cannot be snapshotted; the message says what is wrong and where."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    ref: str
    commit: str
    tree: str
    parent: str | None
    files: int
    bytes: int


def snapshot_ref(workspace_key: str, seq: int) -> str:
    """The kernel ref that retains the snapshot of sleep `seq` of a workspace."""
    if not workspace_key or "/" in workspace_key or workspace_key.startswith(".") or ".." in workspace_key:
        raise ValueError(f"workspace key {workspace_key!r} is not a single safe ref component")
    if seq < 0:
        raise ValueError(f"sleep seq must be >= 0, got {seq}")
    return f"{REF_PREFIX}/{workspace_key}/{seq}"


def filter_overrides(driver_names: Iterable[str]) -> list[tuple[str, str]]:
    """Command-scope config that replaces each named filter driver with a pass-through that runs no agent code."""
    out: list[tuple[str, str]] = []
    for name in sorted(set(driver_names)):
        out.extend((f"filter.{name}.{key}", value) for key, value in FILTER_KEYS)
    return out


def git_env(
    workspace: str | os.PathLike[str],
    *,
    filter_drivers: Iterable[str] = (),
    index_file: str | None = None,
    git_dir: str | None = None,
    extra_config: Iterable[tuple[str, str]] = (),
) -> dict[str, str]:
    """The complete environment for a git run on `workspace` (built from nothing: no variable is inherited).

    `git_dir` defaults to `<workspace>/.git`; callers that hold the checked `.git` open pass `/proc/self/fd/N`
    so that a `.git` swapped for a symlink after the check cannot redirect git to another repository.
    """
    ws = os.fspath(workspace)
    config = [*NEUTRAL_CONFIG, ("safe.directory", ws), *filter_overrides(filter_drivers), *extra_config]
    env = {
        "PATH": SAFE_PATH,
        "LANG": "C",
        "LC_ALL": "C",
        "GIT_DIR": git_dir or os.path.join(ws, ".git"),
        "GIT_WORK_TREE": ws,
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_SYSTEM": "/dev/null",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_SSH_COMMAND": "false",
        "GIT_ASKPASS": "false",
        "GIT_PAGER": "cat",
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_NO_LAZY_FETCH": "1",
        "GIT_PROTOCOL_FROM_USER": "0",
        "GIT_CONFIG_COUNT": str(len(config)),
    }
    for i, (key, value) in enumerate(config):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    if index_file is not None:
        env["GIT_INDEX_FILE"] = index_file
    return env


def git_argv(*args: str) -> list[str]:
    return ["git", "--no-pager", "--literal-pathspecs", *args]


def open_git_dir(workspace: Path) -> int:
    """An fd on the workspace's `.git`, refusing anything that would make git read outside the workspace."""
    dot_git = workspace / ".git"
    try:
        st = os.lstat(dot_git)
    except FileNotFoundError:
        raise SnapshotError(f"{workspace}: not a git repository (no .git directory)") from None
    if stat.S_ISLNK(st.st_mode):
        raise SnapshotError(f"{dot_git} is a symlink; the workspace's .git must be a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise SnapshotError(
            f"{dot_git} is not a directory (a gitfile or worktree link?); the workspace's .git must be a real "
            "directory"
        )
    try:
        fd = os.open(dot_git, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SnapshotError(f"{dot_git} cannot be opened as a directory: {e.strerror}") from None
    try:
        for rel, why in (
            ("objects/info/alternates", "alternates make git read objects from outside the workspace"),
            ("commondir", "a commondir makes git use a repository outside the workspace"),
        ):
            try:
                os.stat(rel, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            raise SnapshotError(f"{dot_git / rel} exists: {why}; remove it to snapshot this workspace")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open(workspace: str | os.PathLike[str]) -> tuple[Path, int]:
    ws = Path(os.path.realpath(workspace))
    return ws, open_git_dir(ws)


def parse_config_names(listing: bytes) -> list[str]:
    """Key names from `git config --list --name-only -z` output."""
    return [n.decode("utf-8", "replace").lower() for n in listing.split(b"\0") if n]


def config_problems(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(refusals, filter driver names) from the repo's config key names."""
    refusals: list[str] = []
    drivers: set[str] = set()
    for name in names:
        section = name.split(".", 1)[0]
        if section in ("include", "includeif"):
            refusals.append(f"config key {name!r} includes another file; includes are refused")
        elif section == "filter" and name.count(".") >= 2:
            drivers.add(name.split(".", 1)[1].rsplit(".", 1)[0])
    return refusals, sorted(drivers)


def _cquote(path: bytes) -> bytes:
    """A C-style quoted path for fast-import (safe for any byte but NUL)."""
    out = bytearray(b'"')
    for b in path:
        if b in (0x22, 0x5C):
            out += b"\\" + bytes([b])
        elif b < 0x20 or b == 0x7F:
            out += b"\\%03o" % b
        else:
            out.append(b)
    out += b'"'
    return bytes(out)


def is_channel_path(path: bytes) -> bool:
    ch = CHANNEL_DIR.encode()
    return path == ch or path.startswith(ch + b"/")


def valid_repo_path(path: bytes) -> bool:
    parts = path.split(b"/")
    return bool(path) and all(p not in (b"", b".", b"..") for p in parts) and parts[0] != b".git"


class _TreeReader:
    """Reads workspace entries relative to a root directory fd, never following a symlink on the way."""

    def __init__(self, root: Path) -> None:
        self._root = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._dirs: dict[bytes, int | None] = {b"": self._root}

    def close(self) -> None:
        for fd in {fd for fd in self._dirs.values() if fd is not None}:
            os.close(fd)
        self._dirs.clear()

    def _dir(self, rel: bytes) -> int | None:
        if rel in self._dirs:
            return self._dirs[rel]
        parent, _, name = rel.rpartition(b"/")
        pfd = self._dir(parent)
        fd: int | None = None
        if pfd is not None:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            except OSError:
                fd = None  # gone, or a symlink/file now: nothing below it is part of the workspace
        self._dirs[rel] = fd
        return fd

    def read(self, rel: bytes, max_bytes: int) -> tuple[str, bytes] | None:
        """(git mode, content) for a file or symlink at `rel`, or None when it is not there (or not either)."""
        parent, _, name = rel.rpartition(b"/")
        pfd = self._dir(parent)
        if pfd is None:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                try:
                    return "120000", os.fsencode(os.readlink(name, dir_fd=pfd))
                except OSError:
                    return None
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENXIO):
                return None
            raise SnapshotError(f"cannot read {os.fsdecode(rel)!r} in the workspace: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            chunks: list[bytes] = []
            size = 0
            while chunk := os.read(fd, 1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise SnapshotError(
                        f"{os.fsdecode(rel)!r} is larger than the snapshot's per-file cap of {max_bytes} bytes; "
                        "ignore it in .gitignore or make it smaller"
                    )
                chunks.append(chunk)
            return ("100755" if st.st_mode & 0o100 else "100644"), b"".join(chunks)
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class _Entry:
    path: bytes
    gitlink: str | None = None  # a tracked submodule's commit, kept as in HEAD


def parse_ls_tree(out: bytes) -> list[_Entry]:
    """Entries of `git ls-tree -r -z --full-tree` output."""
    entries = []
    for rec in out.split(b"\0"):
        if not rec:
            continue
        meta, _, path = rec.partition(b"\t")
        mode, kind, oid = meta.split(b" ")
        entries.append(_Entry(path, oid.decode() if kind == b"commit" and mode == b"160000" else None))
    return entries


def fast_import_stream(
    entries: Iterable[_Entry],
    reader: _TreeReader,
    *,
    ref: str,
    parent: str | None,
    message: str,
    when: int,
    max_file_bytes: int,
    max_total_bytes: int,
    counts: list[int],
) -> Iterator[bytes]:
    """The `git fast-import` stream for one commit holding exactly `entries` as read from the workspace."""
    msg = message.encode()
    yield b"reset %s\n" % ref.encode()
    yield b"commit %s\nmark :1\n" % ref.encode()
    yield b"committer %s %d +0000\n" % (COMMITTER.encode(), when)
    yield b"data %d\n%s\n" % (len(msg), msg)
    if parent is not None:
        yield b"from %s\n" % parent.encode()
    yield b"deleteall\n"
    total = 0
    for entry in entries:
        if entry.gitlink is not None:
            yield b"M 160000 %s %s\n" % (entry.gitlink.encode(), _cquote(entry.path))
            counts[0] += 1
            continue
        got = reader.read(entry.path, max_file_bytes)
        if got is None:
            continue
        mode, data = got
        total += len(data)
        if total > max_total_bytes:
            raise SnapshotError(
                f"the workspace holds more than the snapshot cap of {max_total_bytes} bytes of unignored files; "
                "ignore large data in .gitignore"
            )
        yield b"M %s inline %s\ndata %d\n" % (mode.encode(), _cquote(entry.path), len(data))
        yield data
        yield b"\n"
        counts[0] += 1
        counts[1] += len(data)
    yield b"\ndone\n"


async def _git(env: Mapping[str, str], cwd: Path, fd: int, *args: str, check: bool = True) -> bytes:
    result = await anyio.run_process(git_argv(*args), env=dict(env), cwd=cwd, check=False, pass_fds=(fd,))
    if check and result.returncode != 0:
        err = result.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise SnapshotError(f"git {args[0]} failed in {cwd} (exit {result.returncode}): {err}")
    return bytes(result.stdout)


def _run_fast_import(env: Mapping[str, str], cwd: Path, fd: int, stream: Iterator[bytes], tmp: Path) -> str:
    marks = tmp / "marks"
    errlog = tmp / "fast-import.err"
    with open(errlog, "wb") as err:
        proc = subprocess.Popen(
            git_argv("fast-import", "--quiet", "--force", "--done", f"--export-marks={marks}"),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=dict(env),
            cwd=cwd,
            pass_fds=(fd,),
        )
        assert proc.stdin is not None
        try:
            for chunk in stream:
                proc.stdin.write(chunk)
        except BrokenPipeError:
            pass  # fast-import stopped reading: its exit status and stderr say why
        except BaseException:
            proc.kill()
            raise
        finally:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            rc = proc.wait()
    if rc != 0:
        text = errlog.read_text("utf-8", "replace").strip()[-2000:]
        raise SnapshotError(f"git fast-import failed in {cwd} (exit {rc}): {text}")
    for line in marks.read_text().splitlines():
        mark, _, oid = line.partition(" ")
        if mark == ":1":
            return oid.strip()
    raise SnapshotError(f"git fast-import in {cwd} reported no commit")


async def take_snapshot(
    workspace: str | os.PathLike[str],
    ref: str,
    *,
    tmp_dir: str | os.PathLike[str] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    message: str | None = None,
) -> Snapshot:
    """Commit the workspace's current content under `ref` (overwriting an earlier value of that ref).

    `tmp_dir` must be kernel-owned (outside every workspace): it holds the temporary index and fast-import files.
    """
    if not ref.startswith(REF_PREFIX + "/"):
        raise ValueError(f"snapshot refs live under {REF_PREFIX}/, got {ref!r}")
    ws, fd = _open(workspace)
    try:
        return await _snapshot(ws, fd, ref, tmp_dir, max_file_bytes, max_total_bytes, message)
    finally:
        os.close(fd)


async def _snapshot(
    ws: Path,
    fd: int,
    ref: str,
    tmp_dir: str | os.PathLike[str] | None,
    max_file_bytes: int,
    max_total_bytes: int,
    message: str | None,
) -> Snapshot:
    env = git_env(ws, git_dir=f"/proc/self/fd/{fd}")
    names = parse_config_names(
        await _git(env, ws, fd, "config", "--no-includes", "--list", "--name-only", "-z")
    )
    refusals, drivers = config_problems(names)
    if refusals:
        raise SnapshotError(f"{ws}/.git/config: " + "; ".join(refusals))
    with tempfile.TemporaryDirectory(prefix="syscall-snap-", dir=tmp_dir) as tmp_name:
        tmp = Path(tmp_name)
        env = git_env(
            ws, filter_drivers=drivers, index_file=str(tmp / "index"), git_dir=f"/proc/self/fd/{fd}"
        )
        head = await _git(env, ws, fd, "rev-parse", "--verify", "-q", "HEAD^{commit}", check=False)
        parent = head.decode().strip() or None
        entries: dict[bytes, _Entry] = {}
        if parent is not None:
            for e in parse_ls_tree(await _git(env, ws, fd, "ls-tree", "-r", "-z", "--full-tree", parent)):
                entries[e.path] = e
        # The temporary index is empty, so every non-ignored file shows up as "other"; tracked files that an
        # ignore rule now matches come from the HEAD listing above (git keeps tracked files whatever .gitignore says).
        others = await _git(env, ws, fd, "ls-files", "-z", "--others", "--exclude-standard", "--full-name")
        for path in others.split(b"\0"):
            if path and not path.endswith(b"/") and path not in entries:
                entries[path] = _Entry(path)
        chosen = [entries[p] for p in sorted(entries) if valid_repo_path(p) and not is_channel_path(p)]
        reader = _TreeReader(ws)
        counts = [0, 0]
        try:
            stream = fast_import_stream(
                chosen,
                reader,
                ref=ref,
                parent=parent,
                message=message or f"syscall snapshot {ref}",
                when=int(time.time()),
                max_file_bytes=max_file_bytes,
                max_total_bytes=max_total_bytes,
                counts=counts,
            )
            commit = await anyio.to_thread.run_sync(_run_fast_import, env, ws, fd, stream, tmp)
        finally:
            reader.close()
        tree = (await _git(env, ws, fd, "rev-parse", "--verify", f"{commit}^{{tree}}")).decode().strip()
    return Snapshot(ref=ref, commit=commit, tree=tree, parent=parent, files=counts[0], bytes=counts[1])


async def release(workspace: str | os.PathLike[str], ref: str) -> None:
    """Drop the kernel ref of a snapshot (idempotent: a ref already gone is fine)."""
    if not ref.startswith(REF_PREFIX + "/"):
        raise ValueError(f"snapshot refs live under {REF_PREFIX}/, got {ref!r}")
    ws, fd = _open(workspace)
    try:
        await _git(git_env(ws, git_dir=f"/proc/self/fd/{fd}"), ws, fd, "update-ref", "-d", ref)
    finally:
        os.close(fd)
