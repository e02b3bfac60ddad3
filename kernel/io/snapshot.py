"""Snapshot a workspace's current content as a commit in the kernel's own repository (kernel.io.repo).

The snapshot is what a sleep's jobs run and what a submit evaluates (its tree id is compared). It captures the
working tree as it is on disk, dirty and untracked-but-not-ignored files included, `.syscall/` never included,
as a root commit under `refs/snapshots/<seq>` of the workspace's kernel repository (`<run_dir>/repos/<key>.git`).

The workspace, `.git` included, is hostile (docs/threat-model.md). So:
- git never reads the agent's `.git`. The kernel copies what the listing needs (the index, the one
  `sharedindex.<id>` a split index's link extension names, and `info/exclude`) through fds opened with
  `O_NOFOLLOW` into a kernel-owned scratch git directory, and git only LISTS files against that copy: the tracked
  ones (`ls-files --cached`) and every file not ignored (`ls-files --others`, which reads the tree's `.gitignore`
  files). No config, hook, filter, alternate or object of the agent's is ever read, and nothing is written to its
  `.git` (no index refresh, no lock, no ref, no reflog, no object).
- Every limit is on the total and applied before the expensive step: an index whose header declares more entries
  than the file limit is refused before its entries are read (`_read_index`), an index larger than its entry
  count allows is refused from its size, and the untracked listing stops at the file limit and at
  MAX_LISTING_BYTES of names.
- Listing the live tree never blocks the kernel: git runs under a deadline with a watch for an open() blocked on a
  FIFO, socket or device (kernel.io.gitlisting), and a tree that cannot be listed is the agent's SnapshotError
  naming the path when known, never the kernel's outage.
- With a `jail` (the kernel's jail is bwrap) both listings run in the listing jail (kernel.node.jail
  `listing_bwrap_argv`): git parses the index copy and the tree's `.gitignore` files with the workspace and the
  scratch git directory read-only and nothing else of the host in sight. Without one (jail = none or apptainer)
  they run on the host as the kernel's user, unjailed, under the same bounds.
- The kernel reads every file itself, walking directory fds with `O_NOFOLLOW` (and opening files `O_NONBLOCK`,
  fstat-checked regular), so a directory swapped for a symlink mid-snapshot cannot make it read outside the
  workspace, a FIFO cannot block it, and the content goes to `git fast-import` (into the kernel's repository)
  byte for byte: no clean filter, no eol conversion.
- `.git` must be a real directory. HEAD is read without git, and only to name the snapshot's parent in its
  message (the snapshot is a root commit: the agent's history is not the kernel's).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio.to_thread

from channel.paths import CHANNEL_DIR
from kernel.core.config import Config
from kernel.core.gitindex import entry_count, shared_index_id, surely_untracked
from kernel.io import repo as R
from kernel.io.gitlisting import (
    ListingBlocked,
    ListingJailFailed,
    ListingTimeout,
    ListingTooLarge,
    run_listing,
)
from kernel.io.repo import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_TOTAL_BYTES,
    FileEntry,
    KernelRepo,
    RepoError,
    UntrustedGit,
    is_channel_path,
    valid_repo_path,
)
from kernel.node.jail import JailPolicy

__all__ = ["DEFAULT_MAX_FILE_BYTES", "DEFAULT_MAX_TOTAL_BYTES", "is_channel_path", "valid_repo_path"]

# What the agent's index (and the shared index a split one names) may take together. Within that, an index is
# read at most at INDEX_EXTENSIONS_BYTES + INDEX_ENTRY_BYTES per entry its header declares (an entry is 62 bytes
# and its path; the extensions, cache tree and untracked cache, grow with the directories), so a sparse file of
# a few entries and hundreds of megabytes is refused from its size alone.
MAX_INDEX_BYTES: Final = 512 * 1024 * 1024
INDEX_EXTENSIONS_BYTES: Final = 32 * 1024 * 1024
INDEX_ENTRY_BYTES: Final = 4096
MAX_EXCLUDE_BYTES: Final = 16 * 1024 * 1024
# A listing of the live tree ends by then (kernel.io.gitlisting), well inside the heavy deadline, and holds at
# most this much output (the untracked names; their count is bounded by the file limit as they come).
LIST_DEADLINE_S: Final = 60.0
MAX_LISTING_BYTES: Final = 256 * 1024 * 1024
# git's address space while it lists (kernel.io.gitlisting): a base for git itself and the .gitignore files it
# reads whole, and room for the index copy it maps and the entries it builds from it (a few times its size).
LIST_MEMORY_BASE: Final = 1024 * 1024 * 1024
LIST_MEMORY_PER_INDEX_BYTE: Final = 4


class SnapshotError(Exception):
    """The workspace cannot be snapshotted; the message says what is wrong and where (the agent's to fix)."""


class SnapshotTooLarge(SnapshotError):
    """The workspace is past a snapshot limit (files, bytes, depth); the message names the limit and the fix."""


DEFAULT_MAX_FILES: Final = 200_000
DEFAULT_MAX_DEPTH: Final = 64
_FIX: Final = (
    "list generated data, checkpoints and environments in .gitignore (ignored files are never snapshotted)"
)


def check_limits(paths: list[bytes], max_files: int, max_depth: int) -> None:
    """Raise SnapshotTooLarge when the chosen paths are more than `max_files`, or one is deeper than
    `max_depth` components (pure; before any file is read)."""
    if len(paths) > max_files:
        raise SnapshotTooLarge(
            f"the workspace has {len(paths)} unignored files, more than the snapshot limit of {max_files}; {_FIX}"
        )
    for p in paths:
        if p.count(b"/") + 1 > max_depth:
            raise SnapshotTooLarge(
                f"{os.fsdecode(p)!r} is {p.count(b'/') + 1} directories deep, past the snapshot limit of "
                f"{max_depth}; {_FIX}"
            )


@dataclass(frozen=True, slots=True)
class Snapshot:
    ref: str
    commit: str
    tree: str
    parent: str | None  # the agent's HEAD when the snapshot was taken (informational)
    files: int
    bytes: int


# Directory fds the walk keeps open at most (the root aside). Files come in sorted path order, so a small cache
# of the most recently used directories serves nearly every lookup; a tree of 20,000 directories no longer holds
# 20,000 fds (other workspaces' channels then failed with EMFILE).
MAX_DIR_FDS: Final = 64
# An entry that is not (or no longer) a directory we may enter: nothing below it is part of the workspace.
_GONE_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES})


class _TreeReader:
    """Reads workspace entries relative to a root directory fd, never following a symlink on the way.

    Invariant: at most MAX_DIR_FDS directory fds are open besides the root (least recently used closed first);
    every directory is opened from its parent's fd with O_NOFOLLOW, so reopening an evicted one never leaves the
    tree. An error other than "not there / not a directory" (EMFILE, EIO) fails the snapshot instead of silently
    leaving the directory's files out."""

    def __init__(self, root: Path, max_fds: int = MAX_DIR_FDS) -> None:
        self._root = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._dirs: OrderedDict[bytes, int | None] = OrderedDict()
        self._max = max(2, max_fds)
        self._open = 0

    def close(self) -> None:
        for fd in self._dirs.values():
            if fd is not None:
                os.close(fd)
        self._dirs.clear()
        self._open = 0
        os.close(self._root)

    def _dir(self, rel: bytes) -> int | None:
        if not rel:
            return self._root
        if rel in self._dirs:
            self._dirs.move_to_end(rel)
            return self._dirs[rel]
        parent, _, name = rel.rpartition(b"/")
        pfd = self._dir(parent)
        fd: int | None = None
        if pfd is not None:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            except OSError as e:
                if e.errno not in _GONE_ERRNOS:
                    raise
                fd = None  # gone, or a symlink/file now: nothing below it is part of the workspace
        self._dirs[rel] = fd
        if fd is not None:
            self._open += 1
            while self._open > self._max:
                old_rel, old_fd = next(iter(self._dirs.items()))
                del self._dirs[old_rel]
                if old_fd is not None:
                    os.close(old_fd)
                    self._open -= 1
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
    gitlink: str | None = None  # a tracked submodule's commit, kept as in the index


def parse_ls_files_stage(out: bytes) -> list[_Entry]:
    """Entries of `git ls-files -z -s` output (`<mode> <oid> <stage>\t<path>`; a conflicted path once)."""
    seen: dict[bytes, _Entry] = {}
    for rec in out.split(b"\0"):
        if not rec:
            continue
        meta, _, path = rec.partition(b"\t")
        mode, oid, _stage = meta.split(b" ")
        if path not in seen:
            seen[path] = _Entry(path, oid.decode() if mode == b"160000" else None)
    return list(seen.values())


def _files(
    entries: Iterable[_Entry],
    reader: _TreeReader,
    max_file_bytes: int,
    max_total_bytes: int,
    counts: list[int],
) -> Iterator[FileEntry]:
    total = 0
    for entry in entries:
        if entry.gitlink is not None:
            counts[0] += 1
            yield FileEntry(entry.path, "160000", gitlink=entry.gitlink)
            continue
        got = reader.read(entry.path, max_file_bytes)
        if got is None:
            continue
        mode, data = got
        total += len(data)
        if total > max_total_bytes:
            raise SnapshotTooLarge(
                f"the workspace holds more than the snapshot limit of {max_total_bytes} bytes of unignored "
                f"files; {_FIX}"
            )
        counts[0] += 1
        counts[1] += len(data)
        yield FileEntry(entry.path, mode, data=data)


def _index_cap(entries: int | None, budget: int) -> int:
    """The most bytes an index declaring `entries` entries is read at here (within `budget`, what the index and
    its shared index may take together)."""
    return min(budget, INDEX_EXTENSIONS_BYTES + (entries or 0) * INDEX_ENTRY_BYTES)


def _read_index(git_fd: int, where: str, name: str, max_entries: int | None, budget: int) -> bytes | None:
    """The bytes of `<.git>/<name>` (an index), or None when absent. Before a byte past the header is read: more
    entries than `max_entries` is SnapshotTooLarge, a file larger than an index of that many entries can be
    (`_index_cap`) is SnapshotError, so neither the kernel nor git spends memory, disk or time on the entries."""
    fd = R.open_file_at(git_fd, name, where)
    if fd is None:
        return None
    try:
        entries = entry_count(os.pread(fd, 12, 0))
        if entries is not None and max_entries is not None and entries > max_entries:
            raise SnapshotTooLarge(
                f"{where}/{name} holds {entries} entries (a conflicted path counts once per stage), more than the "
                f"snapshot limit of {max_entries} files; untrack what need not be snapshotted (`git rm -r --cached "
                f"<dir>`) and {_FIX}"
            )
        cap = _index_cap(entries, budget)
        size = os.fstat(fd).st_size
        if size > cap:
            raise SnapshotError(
                f"{where}/{name} is {size} bytes, more than the {cap} bytes an index of {entries or 0} entries may "
                "take here (a corrupt or planted index?); rebuild it with `rm .git/index && git reset`"
            )
    except BaseException:
        os.close(fd)
        raise
    return R.read_fd(fd, cap, f"{where}/{name}")


def _scratch_git_dir(git_fd: int, where: str, dst: Path, max_entries: int | None) -> int:
    """A kernel-owned git directory holding copies of the agent's index (and, for a split index, the one shared
    index its `link` extension names) and info/exclude, read without links and bounded as `_read_index` says.
    Returns the bytes of index copied (the index and its shared index)."""
    for d in ("objects", "refs", "info"):
        (dst / d).mkdir(parents=True)
    (dst / "HEAD").write_text("ref: refs/heads/syscall-snapshot\n")
    (dst / "config").write_text("[core]\n\trepositoryformatversion = 0\n\tbare = false\n")
    index = _read_index(git_fd, where, "index", max_entries, MAX_INDEX_BYTES)
    copied = 0
    if index is not None:
        (dst / "index").write_bytes(index)
        copied = len(index)
        # A split index (core.splitIndex) keeps most entries in the one `sharedindex.<id>` it names; no other file
        # beside it is read (git reads only that one, and a missing copy makes git refuse the index).
        shared = shared_index_id(index)
        if shared is not None:
            name = f"sharedindex.{shared}"
            data = _read_index(git_fd, where, name, max_entries, MAX_INDEX_BYTES - len(index))
            if data is not None:
                (dst / name).write_bytes(data)
                copied += len(data)
    exclude = R.read_file_at(git_fd, "info/exclude", where, MAX_EXCLUDE_BYTES)
    if exclude is not None:
        (dst / "info" / "exclude").write_bytes(exclude)
    return copied


@dataclass(frozen=True, slots=True)
class _Lister:
    """How the workspace `ws` is listed: git's environment (against the scratch git directory `scratch`), its
    memory cap, and the listing jail (None: unjailed)."""

    ws: str
    scratch: Path
    env: dict[str, str]
    memory: int
    jail: JailPolicy | None


def _listing(how: _Lister, max_files: int | None, *args: str) -> tuple[int, bytes, str]:
    """One bounded git listing of the workspace (kernel.io.gitlisting); its failures are the agent's
    (SnapshotError), but for a jail that cannot start (RepoError: the kernel's side)."""
    ws, memory = how.ws, how.memory
    try:
        rc, out, why = run_listing(
            R.git_argv(*args),
            how.env,
            ws,
            deadline=LIST_DEADLINE_S,
            max_bytes=MAX_LISTING_BYTES,
            max_records=max_files,
            max_memory=memory,
            jail=how.jail,
            readable=[str(how.scratch)],
        )
    except ListingJailFailed as e:
        raise RepoError(f"the jail of the snapshot's git listing of {ws} could not start: {e}") from None
    except ListingBlocked as e:
        raise SnapshotError(
            f"{e.path!r} in the workspace is a FIFO, socket or device, and git blocks opening it while listing the "
            "files (git reads every .gitignore it meets); remove it or make it a regular file"
        ) from None
    except ListingTimeout:
        raise SnapshotError(
            f"the files of {ws} could not be listed within {LIST_DEADLINE_S:g} s (a .gitignore that is a FIFO, "
            "or a directory that does not answer?); make every .gitignore a regular file"
        ) from None
    except ListingTooLarge as e:
        raise SnapshotTooLarge(f"the workspace has {e} unignored, past the snapshot limit; {_FIX}") from None
    if rc != 0 and "Out of memory" in why:
        why += f" (git may use {memory} bytes here: is a .gitignore that large?)"
    return rc, out, why


def list_workspace(
    ws: str, git_fd: int, tmp: Path, max_files: int, jail: JailPolicy | None = None
) -> tuple[list[_Entry], list[bytes]]:
    """(tracked entries, untracked-not-ignored paths) of the workspace, listed against a copy of its index (in
    `jail` when given); more than `max_files` index entries, or untracked names, is SnapshotTooLarge before either
    is parsed whole."""
    where = os.path.join(ws, ".git")
    scratch = tmp / "gitdir"
    copied = _scratch_git_dir(git_fd, where, scratch, max_files)
    memory = LIST_MEMORY_BASE + LIST_MEMORY_PER_INDEX_BYTE * copied
    env = R.neutral_env(str(scratch), work_tree=ws, index_file=str(scratch / "index"))
    how = _Lister(ws, scratch, env, memory, jail)
    rc, out, why = _listing(how, None, "ls-files", "-z", "-s", "--cached", "--full-name")
    if rc != 0:
        raise SnapshotError(
            f"{where}/index cannot be read: {why} (a sparse index? run `git sparse-checkout disable`)"
        )
    tracked = parse_ls_files_stage(out)
    # The channel is excluded on the command line, which no .gitignore of the agent's can re-include (git checks
    # command-line patterns first), so its files never count against the limit.
    others = ("ls-files", "-z", "--others", "--exclude-standard", f"--exclude=/{CHANNEL_DIR}/", "--full-name")
    rc, out, why = _listing(how, max_files, *others)
    if rc != 0:
        raise SnapshotError(f"listing the untracked files of {ws} failed: {why}")
    return tracked, [p for p in out.split(b"\0") if p and not p.endswith(b"/")]


def listing_jail(cfg: Config) -> JailPolicy | None:
    """The jail a git listing of a workspace runs in on the kernel's host (kernel.io.gitlisting): bwrap when the
    kernel's jail is, with the state and run directories masked where a system directory would show them; None
    (unjailed) with jail = none or apptainer (apptainer jails jobs on the nodes, not the kernel's own processes)."""
    if cfg.jail != "bwrap":
        return None
    return JailPolicy(kind="bwrap", hide=(cfg.state_dir, cfg.run_dir))


def tracked_under(workspace: str, prefix: str, jail: JailPolicy | None = None) -> list[str]:
    """Paths below `prefix` that the workspace's index tracks, listed against a kernel-owned copy of the index (a
    bounded listing, in `jail` when given)."""
    try:
        git_fd = R.open_dot_git(workspace)
    except UntrustedGit as e:
        raise SnapshotError(str(e)) from None
    try:
        # Most indexes settle it from their bytes (kernel.core.gitindex); the rest ask git, as before. What the
        # copy for git reads is read here too, so a planted link is refused the same way on either path.
        where = os.path.join(workspace, ".git")
        try:
            index = _read_index(git_fd, where, "index", None, MAX_INDEX_BYTES)
            R.read_file_at(git_fd, "info/exclude", where, MAX_EXCLUDE_BYTES)
        except UntrustedGit:
            index = b""  # not settled here: the copy below refuses it, saying why
        if surely_untracked(index, prefix):
            return []
        with tempfile.TemporaryDirectory(prefix="syscall-ls-") as t:
            scratch = Path(t) / "gitdir"
            try:
                copied = _scratch_git_dir(git_fd, os.path.join(workspace, ".git"), scratch, None)
            except UntrustedGit as e:
                raise SnapshotError(str(e)) from None
            env = R.neutral_env(str(scratch), work_tree=workspace, index_file=str(scratch / "index"))
            how = _Lister(
                workspace, scratch, env, LIST_MEMORY_BASE + LIST_MEMORY_PER_INDEX_BYTE * copied, jail
            )
            rc, out, why = _listing(how, None, "ls-files", "-z", "--cached", "--", prefix)
            if rc != 0:
                raise SnapshotError(f"{workspace}/.git/index cannot be read: {why}")
    finally:
        os.close(git_fd)
    return [p.decode("utf-8", "replace") for p in out.split(b"\0") if p]


def snapshot_sync(
    workspace: str | os.PathLike[str],
    repo: KernelRepo,
    seq: int,
    *,
    tmp_dir: str | os.PathLike[str],
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    message: str | None = None,
    jail: JailPolicy | None = None,
) -> Snapshot:
    """Commit the workspace's current content under `refs/snapshots/<seq>` of `repo` (overwriting that ref).

    `tmp_dir` must be kernel-owned (outside every workspace). `jail`: the bwrap policy git lists the workspace in
    (the kernel's jail is bwrap), or None to list it unjailed. SnapshotError: the agent's to fix; RepoError or
    OSError: the kernel's side failed."""
    ws = os.path.realpath(workspace)
    ref = R.snapshot_ref(seq)
    try:
        git_fd = R.open_dot_git(ws)
    except UntrustedGit as e:
        raise SnapshotError(str(e)) from None
    try:
        try:
            parent = R.read_head(git_fd, os.path.join(ws, ".git"))
        except (UntrustedGit, OSError):
            parent = None  # HEAD only names the parent in the message; a linked ref is not followed
        Path(tmp_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="syscall-snap-", dir=tmp_dir) as t:
            try:
                tracked, others = list_workspace(ws, git_fd, Path(t), max_files, jail)
            except UntrustedGit as e:
                raise SnapshotError(str(e)) from None
            entries = {e.path: e for e in tracked}
            for path in others:
                entries.setdefault(path, _Entry(path))
            chosen = [entries[p] for p in sorted(entries) if valid_repo_path(p) and not is_channel_path(p)]
            check_limits([e.path for e in chosen], max_files, max_depth)
            reader = _TreeReader(Path(ws))
            counts = [0, 0]
            try:
                files = _files(chosen, reader, max_file_bytes, max_total_bytes, counts)
                text = message or f"syscall snapshot {seq} of {ws}" + (f" (HEAD {parent})" if parent else "")
                commit, tree = repo.import_files(ref, text + "\n", files, Path(t))
            finally:
                reader.close()
    finally:
        os.close(git_fd)
    return Snapshot(ref=ref, commit=commit, tree=tree, parent=parent, files=counts[0], bytes=counts[1])


async def take_snapshot(
    workspace: str | os.PathLike[str],
    repo: KernelRepo,
    seq: int,
    *,
    tmp_dir: str | os.PathLike[str],
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    jail: JailPolicy | None = None,
) -> Snapshot:
    """`snapshot_sync` in a worker thread."""

    def run() -> Snapshot:
        return snapshot_sync(
            workspace,
            repo,
            seq,
            tmp_dir=tmp_dir,
            max_file_bytes=max_file_bytes,
            max_total_bytes=max_total_bytes,
            max_files=max_files,
            max_depth=max_depth,
            jail=jail,
        )

    return await anyio.to_thread.run_sync(run)


def release_sync(repo: KernelRepo, seq: int) -> None:
    """Drop the ref of a snapshot (idempotent: a ref already gone, or a repository never made, is fine)."""
    if (repo.path / "HEAD").is_file():
        repo.delete_ref(R.snapshot_ref(seq))


async def release(repo: KernelRepo, seq: int) -> None:
    await anyio.to_thread.run_sync(release_sync, repo, seq)
