"""The kernel-owned git repository of one workspace: every snapshot, every held base, every evaluation tree.

The agent owns its workspace, `.git` included (docs/threat-model.md): it can plant symlinks there, rewrite objects
in place (same id, other bytes) and set any config. So the kernel writes NOTHING into the agent's `.git`, and
what jobs run never comes from it:

- Each workspace has a bare repository `<run_dir>/repos/<workspace-key>.git`, created and configured by the kernel
  (no jail binds `run_dir`; compute nodes read it). Snapshots are committed there under `refs/snapshots/<seq>`
  (released after the wake), bases under `refs/bases/<tree>` (never released, so never pruned).
- The base commit (at enroll, at `syscall-kernel rebase`, and when an older kernel's base is re-imported) is the
  only content the kernel takes from the agent's `.git`. `import_base` copies the object store it needs into a
  kernel-owned temporary directory, walking directory fds with `O_NOFOLLOW` (any symlink is refused, naming the
  path; only `objects/xx/…` and `objects/pack/pack-*.{idx,pack}` are taken, so alternates never are), reads the
  commit, every tree and every blob from that copy, and RE-HASHES each object itself: a mismatch
  (`ObjectMismatch`) names the object and the path. Only then are the files imported, byte for byte, into the
  kernel's repository, whose own tree id is the one the kernel records, compares and keys baselines by.
- `read_head` reads HEAD (and the branch it names, loose or in packed-refs) through fds, without git.

The interface for other modules (issue 11 reads protected files of the base through it):
    repo = KernelRepo.at(run_dir, key); repo.ensure()
    base = import_base(repo, workspace, "HEAD")          # -> Base(commit, tree); held under refs/bases/<tree>
    repo.list_tree(base.tree) -> [TreeEntry(mode, oid, path)]; repo.read_blob(base.tree, "eval.sh") -> bytes|None
Everything here is synchronous (git processes through kernel.io.hostproc); async callers use a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from channel.paths import CHANNEL_DIR, RunPaths, key_is_safe
from kernel.io import hostproc

SAFE_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
COMMITTER: Final = "syscall-kernel <kernel@syscall.invalid>"
SNAPSHOT_PREFIX: Final = "refs/snapshots/"
BASE_PREFIX: Final = "refs/bases/"
GC_STAMP: Final = "syscall-gc-stamp"
LEGACY_REPORTED: Final = "syscall-legacy-refs-reported"
GIT_TIMEOUT_S: Final = 600
DEFAULT_MAX_FILE_BYTES: Final = 256 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES: Final = 2 * 1024 * 1024 * 1024
# The most bytes (and files) of the agent's object store that a base import copies before giving up.
DEFAULT_MAX_STORE_BYTES: Final = 8 * 1024 * 1024 * 1024
MAX_STORE_FILES: Final = 200_000
MAX_REF_BYTES: Final = 64 * 1024 * 1024

# Config every git the kernel or the job wrapper runs gets in command scope: nothing runs a program the
# repository chose, nothing reads outside it, nothing writes in the background.
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
    ("core.logAllRefUpdates", "false"),
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

_OID: Final = re.compile(rb"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_LOOSE_DIR: Final = re.compile(r"[0-9a-f]{2}")
_LOOSE_NAME: Final = re.compile(r"[0-9a-f]{38}(?:[0-9a-f]{24})?")
_PACK_NAME: Final = re.compile(r"pack-[0-9a-f]{40,64}\.(?:idx|pack)")
_O_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RepoError(Exception):
    """The kernel's own repository failed (the world's fault: disk, git missing); the message says where."""


class UntrustedGit(Exception):
    """What the agent's `.git` holds cannot be taken (a symlink, an odd file, a missing object); the message
    names the path and says how to fix it. The agent's (or operator's) to fix, never retried as is."""


class ObjectMismatch(UntrustedGit):
    """An object read from the agent's `.git` does not hash to its id: it was rewritten in place."""


@dataclass(frozen=True, slots=True)
class Base:
    commit: str  # the agent's commit id (its object re-hashed by the kernel)
    tree: str  # the tree id in the KERNEL's repository (what is compared, materialised and keyed)


@dataclass(frozen=True, slots=True)
class TreeEntry:
    mode: str
    oid: str
    path: str


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One entry to import: a file or symlink (`data`) or a submodule (`gitlink`, a commit id)."""

    path: bytes
    mode: str
    data: bytes | None = None
    gitlink: str | None = None


def neutral_env(
    git_dir: str, *, work_tree: str | None = None, index_file: str | None = None
) -> dict[str, str]:
    """The complete environment for a git run (built from nothing: no variable is inherited)."""
    config = [*NEUTRAL_CONFIG, ("safe.directory", "*")]
    env = {
        "PATH": SAFE_PATH,
        "LANG": "C",
        "LC_ALL": "C",
        "GIT_DIR": git_dir,
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
    if work_tree is not None:
        env["GIT_WORK_TREE"] = work_tree
    if index_file is not None:
        env["GIT_INDEX_FILE"] = index_file
    return env


def git_argv(*args: str) -> list[str]:
    return ["git", "--no-pager", "--literal-pathspecs", *args]


GIT: Final = hostproc.declare(
    "git",
    agent_input="the agent's file bytes and names as data: blobs stored and re-hashed, trees listed; the config "
    "file of the agent's .git parsed for one key (--no-includes); never the agent's .git itself",
    containment="a kernel-owned or scratch git directory, an environment built from nothing (neutral_env: no "
    "config, hook, filter, attribute, pager or credential helper of anyone's), a deadline of GIT_TIMEOUT_S",
    timeout_s=GIT_TIMEOUT_S,
)
GIT_STREAM: Final = hostproc.declare(
    "git.stream",
    agent_input="the agent's file bytes streamed to fast-import as blobs, object ids to cat-file --batch: data, "
    "never interpreted",
    containment="as `git`; the caller streams, then closes the pipe and reaps the process in every case",
)


def run_git(
    env: Mapping[str, str], cwd: str | os.PathLike[str], *args: str, stdin: bytes | None = None
) -> hostproc.CompletedProcess[bytes]:
    try:
        return hostproc.run(GIT, git_argv(*args), env=env, cwd=cwd, input=stdin)
    except FileNotFoundError:
        raise RepoError("git is not installed; the kernel needs it for snapshots and bases") from None
    except hostproc.TimeoutExpired:
        raise RepoError(f"git {args[0]} did not finish within {GIT_TIMEOUT_S} s") from None


def first_line(out: hostproc.CompletedProcess[bytes]) -> str:
    lines = out.stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else f"exit {out.returncode}"


def object_id(kind: str, data: bytes, algo: str = "sha1") -> str:
    """git's id of an object: the hash of `<kind> <size>\\0<data>`."""
    h = hashlib.new(algo)
    h.update(b"%s %d\0" % (kind.encode(), len(data)))
    h.update(data)
    return h.hexdigest()


def parse_tree(data: bytes, algo: str = "sha1") -> list[tuple[str, bytes, str]]:
    """(mode, name, oid) of each entry of a raw tree object; ValueError when it is malformed."""
    width = hashlib.new(algo).digest_size
    out = []
    i = 0
    while i < len(data):
        sp = data.index(b" ", i)
        nul = data.index(b"\0", sp)
        mode = data[i:sp].decode("ascii")
        name = data[sp + 1 : nul]
        raw = data[nul + 1 : nul + 1 + width]
        if len(raw) != width or not mode.isdigit():
            raise ValueError("truncated tree entry")
        out.append((mode, name, raw.hex()))
        i = nul + 1 + width
    return out


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
    """A path a snapshot or base may hold: relative, no empty/./.. component, nothing named .git (any case)."""
    parts = path.split(b"/")
    return bool(path) and all(p not in (b"", b".", b"..") and p.lower() != b".git" for p in parts)


def fast_import_stream(ref: str, message: str, when: int, files: Iterable[FileEntry]) -> Iterator[bytes]:
    """The `git fast-import` stream of one root commit holding exactly `files`."""
    msg = message.encode()
    yield b"reset %s\n" % ref.encode()
    yield b"commit %s\nmark :1\n" % ref.encode()
    yield b"committer %s %d +0000\n" % (COMMITTER.encode(), when)
    yield b"data %d\n%s\n" % (len(msg), msg)
    yield b"deleteall\n"
    for f in files:
        if f.gitlink is not None:
            yield b"M 160000 %s %s\n" % (f.gitlink.encode(), _cquote(f.path))
            continue
        assert f.data is not None
        yield b"M %s inline %s\ndata %d\n" % (f.mode.encode(), _cquote(f.path), len(f.data))
        yield f.data
        yield b"\n"
    yield b"\ndone\n"


# --- the kernel's repository ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelRepo:
    path: Path

    @classmethod
    def at(cls, run_dir: str | os.PathLike[str], key: str) -> KernelRepo:
        if not key_is_safe(key):
            raise ValueError(f"workspace key {key!r} is not a single safe name")
        return cls(RunPaths.repo_of(Path(run_dir), key))

    def env(self) -> dict[str, str]:
        return neutral_env(str(self.path))

    def git(self, *args: str, stdin: bytes | None = None) -> hostproc.CompletedProcess[bytes]:
        return run_git(self.env(), self.path, *args, stdin=stdin)

    def ensure(self) -> None:
        """Create the bare repository if it is not there yet (idempotent; safe against a concurrent creator)."""
        if (self.path / "HEAD").is_file():
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.path.parent))
        try:
            env = neutral_env(str(tmp))
            out = run_git(env, tmp, "init", "--bare", "-q", str(tmp))
            if out.returncode != 0:
                raise RepoError(f"git init {self.path} failed: {first_line(out)}")
            for k, v in (
                ("gc.auto", "0"),
                ("core.logAllRefUpdates", "false"),
                ("receive.denyDeletes", "false"),
            ):
                run_git(env, tmp, "config", k, v)
            shutil.rmtree(tmp / "hooks", ignore_errors=True)
            try:
                os.rename(tmp, self.path)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def rev(self, rev: str) -> str | None:
        out = self.git("rev-parse", "--verify", "-q", "--end-of-options", rev)
        return out.stdout.decode().strip() or None if out.returncode == 0 else None

    def import_files(
        self, ref: str, message: str, files: Iterable[FileEntry], tmp_dir: Path
    ) -> tuple[str, str]:
        """Commit exactly `files` under `ref` (a root commit, overwriting the ref); returns (commit, tree)."""
        self.ensure()
        with tempfile.TemporaryDirectory(prefix="syscall-import-", dir=tmp_dir) as t:
            marks = Path(t) / "marks"
            errlog = Path(t) / "err"
            stream = fast_import_stream(ref, message, int(time.time()), files)
            with open(errlog, "wb") as err:
                proc = hostproc.popen(
                    GIT_STREAM,
                    git_argv("fast-import", "--quiet", "--force", "--done", f"--export-marks={marks}"),
                    stdin=hostproc.PIPE,
                    stdout=hostproc.DEVNULL,
                    stderr=err,
                    env=self.env(),
                    cwd=self.path,
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
                raise RepoError(f"git fast-import into {self.path} failed (exit {rc}): {text}")
            commit = next(
                (
                    oid.strip()
                    for mark, _, oid in (ln.partition(" ") for ln in marks.read_text().splitlines())
                    if mark == ":1"
                ),
                None,
            )
        if commit is None:
            raise RepoError(f"git fast-import into {self.path} reported no commit")
        tree = self.rev(f"{commit}^{{tree}}")
        if tree is None:
            raise RepoError(f"{self.path}: the commit {commit} just imported has no tree")
        return commit, tree

    def has_tree(self, tree: str) -> bool:
        """Whether the repository holds the tree object `tree`."""
        return (self.path / "HEAD").is_file() and self.rev(f"{tree}^{{tree}}") == tree

    def delete_ref(self, ref: str) -> None:
        out = self.git("update-ref", "--no-deref", "-d", ref)
        if out.returncode != 0 and self.rev(ref) is not None:
            raise RepoError(f"cannot delete {ref} in {self.path}: {first_line(out)}")

    def hold(self, ref: str, commit: str) -> None:
        out = self.git("update-ref", "--no-deref", ref, commit)
        if out.returncode != 0:
            raise RepoError(f"cannot set {ref} in {self.path}: {first_line(out)}")

    # --- reading (what evaluation and verdicts read of a held tree) ---

    def list_tree(self, tree: str) -> list[TreeEntry]:
        """Every file, symlink and submodule of `tree` (recursively)."""
        out = self.git("ls-tree", "-r", "-z", "--full-tree", "--end-of-options", tree)
        if out.returncode != 0:
            raise RepoError(f"{tree} is not a tree in {self.path}: {first_line(out)}")
        entries = []
        for rec in out.stdout.split(b"\0"):
            if rec:
                meta, _, path = rec.partition(b"\t")
                mode, _kind, oid = meta.split(b" ")
                entries.append(TreeEntry(mode.decode(), oid.decode(), os.fsdecode(path)))
        return entries

    def read_blob(self, tree: str, path: str) -> bytes | None:
        """The content of the file at `path` in `tree` (re-hashed), or None when there is no such file."""
        out = self.git("ls-tree", "-z", "--full-tree", "--end-of-options", tree, "--", path)
        if out.returncode != 0:
            raise RepoError(f"{tree} is not a tree in {self.path}: {first_line(out)}")
        rec = out.stdout.split(b"\0")[0]
        if not rec:
            return None
        meta, _, _ = rec.partition(b"\t")
        _mode, kind, oid = meta.decode().split(" ")
        if kind != "blob":
            return None
        data = self.git("cat-file", "blob", oid)
        if data.returncode != 0 or object_id("blob", data.stdout) != oid:
            raise RepoError(f"{self.path}: blob {oid} ({path}) cannot be read back intact")
        return data.stdout

    # --- retention ---

    def gc_due(self, every_s: float, now: float | None = None) -> bool:
        try:
            last = os.stat(self.path / GC_STAMP).st_mtime
        except FileNotFoundError:
            if (self.path / "HEAD").is_file():
                (self.path / GC_STAMP).touch()  # the clock starts when the kernel first sees the repository
            return False
        return (now or time.time()) - last >= every_s

    def gc(self, prune: str = "1.hour.ago") -> None:
        """Pack and prune the kernel's repository. Held bases and unreleased snapshots are refs, so they stay;
        a released snapshot's objects go once older than `prune` (a snapshot being written is younger)."""
        out = self.git("gc", "--quiet", f"--prune={prune}")
        if out.returncode != 0:
            raise RepoError(f"git gc in {self.path} failed: {first_line(out)}")
        (self.path / GC_STAMP).touch()


def snapshot_ref(seq: int) -> str:
    if seq < 0:
        raise ValueError(f"sleep seq must be >= 0, got {seq}")
    return f"{SNAPSHOT_PREFIX}{seq}"


def base_ref(tree: str) -> str:
    if not _OID.fullmatch(tree.encode()):
        raise ValueError(f"{tree!r} is not a tree id")
    return f"{BASE_PREFIX}{tree}"


# --- reading the agent's .git through fds ---------------------------------------------------------------------


def open_dot_git(workspace: str | os.PathLike[str]) -> int:
    """An fd on the workspace's `.git`, which must be a real directory (never followed if a symlink)."""
    ws = os.fspath(workspace)
    dot_git = os.path.join(ws, ".git")
    try:
        wfd = os.open(ws, _O_DIR)
    except OSError as e:
        raise UntrustedGit(f"{ws} cannot be opened as a directory: {e.strerror}") from None
    try:
        st = os.stat(".git", dir_fd=wfd, follow_symlinks=False)
    except FileNotFoundError:
        raise UntrustedGit(f"{ws}: not a git repository (no .git directory)") from None
    else:
        if stat.S_ISLNK(st.st_mode):
            raise UntrustedGit(f"{dot_git} is a symlink; the workspace's .git must be a real directory")
        if not stat.S_ISDIR(st.st_mode):
            raise UntrustedGit(
                f"{dot_git} is not a directory (a gitfile or worktree link?); the workspace's .git must be a "
                "real directory"
            )
        try:
            return os.open(".git", _O_DIR, dir_fd=wfd)
        except OSError as e:
            raise UntrustedGit(f"{dot_git} cannot be opened as a directory: {e.strerror}") from None
    finally:
        os.close(wfd)


def _open_at(dfd: int, rel: str, where: str) -> int | None:
    """An fd on the regular file `rel` (components separated by '/') below `dfd`, never through a symlink;
    None when it is absent. UntrustedGit when any component is a symlink or the file is not a regular one."""
    parts = rel.split("/")
    cur = dfd
    opened: list[int] = []
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                fd = os.open(name, _O_FILE if last else _O_DIR, dir_fd=cur)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return None
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
                    shown = "/".join(parts[: i + 1])
                    raise UntrustedGit(
                        f"{where}/{shown} is a symlink or not a {'file' if last else 'directory'}; the kernel "
                        "never follows links in .git: replace it with the real thing"
                    ) from None
                raise
            if last:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise UntrustedGit(f"{where}/{rel} is not a regular file")
                return fd
            opened.append(fd)
            cur = fd
        return None
    finally:
        for fd in opened:
            os.close(fd)


def _read_fd(fd: int, cap: int, what: str) -> bytes:
    chunks = []
    size = 0
    try:
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > cap:
                raise UntrustedGit(f"{what} is larger than {cap} bytes")
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_file_at(dfd: int, rel: str, where: str, cap: int = MAX_REF_BYTES) -> bytes | None:
    fd = _open_at(dfd, rel, where)
    return None if fd is None else _read_fd(fd, cap, f"{where}/{rel}")


def open_file_at(dfd: int, rel: str, where: str) -> int | None:
    """An fd (the caller's to close) on the regular file `rel` below `dfd`, opened as `read_file_at` opens it
    (no symlink followed, O_NONBLOCK, fstat-checked regular); None when absent. For a caller that looks at the
    file (its size, a header) before deciding to read it whole with `read_fd`."""
    return _open_at(dfd, rel, where)


def read_fd(fd: int, cap: int, what: str) -> bytes:
    """The rest of `fd` (closed here), UntrustedGit naming `what` once more than `cap` bytes come."""
    return _read_fd(fd, cap, what)


def _valid_ref_name(name: str) -> bool:
    parts = name.split("/")
    return (
        name.startswith("refs/")
        and all(p and not p.startswith(".") and p not in ("..",) for p in parts)
        and not any(c in name for c in "\0\\ ~^:?*[")
        and ".." not in name
    )


def read_head(git_fd: int, where: str) -> str | None:
    """The commit id HEAD names (through the branch it points at, loose or packed), read without git and
    without following any link; None when HEAD has no commit (or cannot be resolved)."""
    head = read_file_at(git_fd, "HEAD", where, 4096)
    if head is None:
        return None
    text = head.decode("utf-8", "replace").strip()
    for _ in range(5):
        if _OID.fullmatch(text.encode()):
            return text
        if not text.startswith("ref: "):
            return None
        name = text[5:].strip()
        if not _valid_ref_name(name):
            return None
        loose = read_file_at(git_fd, name, where, 4096)
        if loose is not None:
            text = loose.decode("utf-8", "replace").strip()
            continue
        packed = read_file_at(git_fd, "packed-refs", where) or b""
        for line in packed.splitlines():
            oid, _, ref = line.partition(b" ")
            if ref.strip() == name.encode() and _OID.fullmatch(oid):
                return oid.decode()
        return None
    return None


def legacy_refs(git_fd: int, limit: int = 100) -> list[str]:
    """Refs an older kernel left under `refs/syscall/` (at most `limit` names; loose ones listed through
    directory fds and packed ones from `packed-refs`: nothing is followed, read through a link or changed)."""
    found: list[str] = []

    def walk(dfd: int, prefix: str) -> None:
        for name in sorted(os.listdir(dfd)):
            if len(found) >= limit:
                return
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                found.append(f"{prefix}{name} (a symlink, not followed)")
            elif stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _O_DIR, dir_fd=dfd)
                try:
                    walk(sub, f"{prefix}{name}/")
                finally:
                    os.close(sub)
            else:
                found.append(f"{prefix}{name}")

    with contextlib.suppress(UntrustedGit, OSError):
        rfd = _subdir(git_fd, "refs", ".git")
        if rfd is not None:
            try:
                st = os.stat("syscall", dir_fd=rfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    found.append("refs/syscall (a symlink, not followed)")
                elif stat.S_ISDIR(st.st_mode):
                    sfd = os.open("syscall", _O_DIR, dir_fd=rfd)
                    try:
                        walk(sfd, "refs/syscall/")
                    finally:
                        os.close(sfd)
            finally:
                os.close(rfd)
    with contextlib.suppress(UntrustedGit, OSError):
        packed = read_file_at(git_fd, "packed-refs", ".git") or b""
        found += [
            ref.decode("utf-8", "replace")
            for line in packed.splitlines()
            if (ref := line.partition(b" ")[2].strip()).startswith(b"refs/syscall/")
        ]
    return found[:limit]


# --- importing a base through the verified path ---------------------------------------------------------------


def _copy_file(src_dir: int, name: str, dst: Path, where: str, budget: list[int]) -> None:
    fd = _open_at(src_dir, name, where)
    if fd is None:
        return
    try:
        with open(dst, "xb") as out:
            while chunk := os.read(fd, 1 << 20):
                budget[0] -= len(chunk)
                if budget[0] < 0:
                    raise UntrustedGit(
                        f"{where} holds more object data than the kernel copies for a base import; "
                        "run `git gc` there (or make the repository smaller) and try again"
                    )
                out.write(chunk)
    finally:
        os.close(fd)
    budget[1] -= 1
    if budget[1] < 0:
        raise UntrustedGit(
            f"{where} holds more than {MAX_STORE_FILES} object files; run `git gc` there first"
        )


def _subdir(dfd: int, name: str, where: str) -> int | None:
    try:
        return os.open(name, _O_DIR, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedGit(
                f"{where}/{name} is a symlink or not a directory; the kernel never follows links in .git: "
                "replace it with the real directory"
            ) from None
        raise


def copy_object_store(git_fd: int, where: str, dst: Path, max_bytes: int) -> None:
    """Copy the agent's loose objects and packs (nothing else: no alternates, no info/) into `dst/objects`,
    every component opened without following a link."""
    (dst / "objects" / "pack").mkdir(parents=True)
    (dst / "refs").mkdir()
    budget = [max_bytes, MAX_STORE_FILES]
    ofd = _subdir(git_fd, "objects", where)
    if ofd is None:
        return
    try:
        for name in sorted(os.listdir(ofd)):
            if _LOOSE_DIR.fullmatch(name):
                sfd = _subdir(ofd, name, f"{where}/objects")
                if sfd is None:
                    continue
                try:
                    (dst / "objects" / name).mkdir()
                    for leaf in os.listdir(sfd):
                        if _LOOSE_NAME.fullmatch(leaf):
                            _copy_file(
                                sfd, leaf, dst / "objects" / name / leaf, f"{where}/objects/{name}", budget
                            )
                finally:
                    os.close(sfd)
            elif name == "pack":
                pfd = _subdir(ofd, "pack", f"{where}/objects")
                if pfd is None:
                    continue
                try:
                    for leaf in os.listdir(pfd):
                        if _PACK_NAME.fullmatch(leaf):
                            _copy_file(
                                pfd, leaf, dst / "objects" / "pack" / leaf, f"{where}/objects/pack", budget
                            )
                finally:
                    os.close(pfd)
    finally:
        os.close(ofd)


def _object_format(git_fd: int, where: str, tmp: Path) -> str:
    raw = read_file_at(git_fd, "config", where, 1 << 20)
    if raw is None:
        return "sha1"
    (tmp / "agent-config").write_bytes(raw)
    env = neutral_env(str(tmp / "shadow"))
    out = run_git(
        env,
        tmp,
        "config",
        "--no-includes",
        "--file",
        str(tmp / "agent-config"),
        "--get",
        "extensions.objectformat",
    )
    fmt = out.stdout.decode().strip().lower() if out.returncode == 0 else ""
    if fmt in ("", "sha1"):
        return "sha1"
    if fmt == "sha256":
        return "sha256"
    raise UntrustedGit(f"{where}/config: extensions.objectformat {fmt!r} is not one git knows")


class _Objects:
    """Objects of the copied store, each re-hashed before it is handed out."""

    def __init__(self, shadow: Path, algo: str, where: str) -> None:
        self.algo = algo
        self.where = where
        self.proc = hostproc.popen(
            GIT_STREAM,
            git_argv("cat-file", "--batch"),
            stdin=hostproc.PIPE,
            stdout=hostproc.PIPE,
            stderr=hostproc.DEVNULL,
            env=neutral_env(str(shadow)),
            cwd=shadow,
        )

    def close(self) -> None:
        for s in (self.proc.stdin, self.proc.stdout):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self.proc.kill()
        self.proc.wait()

    def get(self, oid: str, kind: str, what: str, cap: int) -> bytes:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None
        assert stdout is not None
        stdin.write(oid.encode() + b"\n")
        stdin.flush()
        header = stdout.readline().split()
        if len(header) == 2 and header[1] == b"missing":
            raise UntrustedGit(f"{self.where}: {what} ({kind} {oid}) is missing from the repository")
        if len(header) != 3 or header[0].decode() != oid:
            raise UntrustedGit(f"{self.where}: {what} ({kind} {oid}) cannot be read")
        size = int(header[2])
        if size > cap:
            raise UntrustedGit(f"{self.where}: {what} is larger than the cap of {cap} bytes")
        data = _read_exact(stdout, size)
        _read_exact(stdout, 1)
        got_kind = header[1].decode()
        if object_id(got_kind, data, self.algo) != oid:
            raise ObjectMismatch(
                f"{self.where}: {what} ({kind} {oid}) does not hash to its id: the object was rewritten in place. "
                "Restore it (e.g. fetch it again from a clone, then `git fsck`), then retry"
            )
        if got_kind != kind:
            raise UntrustedGit(f"{self.where}: {what} ({oid}) is a {got_kind}, expected a {kind}")
        return data


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            raise RepoError("git cat-file output ended early")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _commit_tree(data: bytes) -> str:
    first = data.split(b"\n", 1)[0]
    if not first.startswith(b"tree ") or not _OID.fullmatch(first[5:]):
        raise ValueError("a commit without a tree line")
    return first[5:].decode()


def _walk(
    objs: _Objects, tree: str, prefix: bytes, max_file: int, total: list[int], max_total: int
) -> Iterator[FileEntry]:
    where = os.fsdecode(prefix.rstrip(b"/")) or "(root)"
    raw = objs.get(tree, "tree", f"the tree of {where!r}", max_total)
    try:
        entries = parse_tree(raw, objs.algo)
    except (ValueError, UnicodeDecodeError):
        raise UntrustedGit(f"{objs.where}: the tree of {where!r} ({tree}) is malformed") from None
    for mode, name, oid in entries:
        path = prefix + name
        shown = os.fsdecode(path)
        if not valid_repo_path(path):
            raise UntrustedGit(f"{objs.where}: the base holds an unsafe path {shown!r}")
        if is_channel_path(path):
            continue
        if mode in ("40000", "040000"):
            yield from _walk(objs, oid, path + b"/", max_file, total, max_total)
        elif mode == "160000":
            yield FileEntry(path, mode, gitlink=oid)
        elif mode.startswith("100") or mode == "120000":
            data = objs.get(oid, "blob", f"{shown!r}", max_file)
            total[0] += len(data)
            if total[0] > max_total:
                raise UntrustedGit(f"{objs.where}: the base holds more than {max_total} bytes")
            kept = "120000" if mode == "120000" else ("100755" if int(mode, 8) & 0o100 else "100644")
            yield FileEntry(path, kept, data=data)
        else:
            raise UntrustedGit(f"{objs.where}: {shown!r} has an unknown mode {mode}")


def import_base(
    repo: KernelRepo,
    workspace: str | os.PathLike[str],
    rev: str,
    *,
    tmp_dir: str | os.PathLike[str],
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES,
) -> Base | None:
    """Take `rev` of the workspace's repository as a base: verified object by object, imported into `repo` and
    held there under `refs/bases/<tree>` (never released). None when `rev` is HEAD and HEAD has no commit yet.

    `rev` is a full commit id, or a name resolved against a copy of the agent's refs (read without links).
    """
    if rev.startswith("-"):
        raise UntrustedGit(f"{rev!r} is not a revision")
    ws = os.path.realpath(workspace)
    where = os.path.join(ws, ".git")
    Path(tmp_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    git_fd = open_dot_git(ws)
    try:
        with tempfile.TemporaryDirectory(prefix="syscall-base-", dir=tmp_dir) as t:
            tmp = Path(t)
            algo = _object_format(git_fd, where, tmp)
            shadow = tmp / "shadow"
            copy_object_store(git_fd, where, shadow, max_store_bytes)
            init = neutral_env(str(shadow))
            fmt = ["--object-format=sha256"] if algo == "sha256" else []
            out = run_git(init, tmp, "init", "--bare", "-q", *fmt, str(shadow))
            if out.returncode != 0:
                raise RepoError(f"cannot set up a scratch repository in {tmp}: {first_line(out)}")
            if rev == "HEAD" or not _OID.fullmatch(rev.encode()):
                commit = _resolve(git_fd, where, shadow, rev)
                if commit is None:
                    return None
            else:
                commit = rev
            objs = _Objects(shadow, algo, where)
            try:
                data = objs.get(commit, "commit", f"the base commit {rev!r}", 1 << 20)
                try:
                    tree = _commit_tree(data)
                except ValueError:
                    raise UntrustedGit(f"{where}: the commit {commit} is malformed") from None
                files = list(_walk(objs, tree, b"", max_file_bytes, [0], max_total_bytes))
            finally:
                objs.close()
            files.sort(key=lambda f: f.path)
            incoming = f"{BASE_PREFIX}incoming-{os.getpid()}"
            kcommit, ktree = repo.import_files(incoming, f"syscall base: {commit} of {ws}\n", files, tmp)
            repo.hold(base_ref(ktree), kcommit)
            repo.delete_ref(incoming)
            return Base(commit=commit, tree=ktree)
    finally:
        os.close(git_fd)


def _resolve(git_fd: int, where: str, shadow: Path, rev: str) -> str | None:
    """The commit a name resolves to, against refs copied from the agent's `.git` without following links."""
    if rev == "HEAD":
        return read_head(git_fd, where)
    for name in ("HEAD", "packed-refs"):
        raw = read_file_at(git_fd, name, where)
        if raw is not None:
            (shadow / ("HEAD-agent" if name == "HEAD" else name)).write_bytes(raw)
    rfd = _subdir(git_fd, "refs", where)
    if rfd is not None:
        try:
            _copy_refs(rfd, f"{where}/refs", shadow / "refs", [4096])
        finally:
            os.close(rfd)
    head = read_head(git_fd, where)
    if head is not None:
        (shadow / "HEAD").write_text(head + "\n")
    out = run_git(
        neutral_env(str(shadow)), shadow, "rev-parse", "--verify", "--end-of-options", f"{rev}^{{commit}}"
    )
    if out.returncode != 0:
        raise UntrustedGit(f"{rev!r} is not a commit of {where}: {first_line(out)}")
    return out.stdout.decode().strip()


def _copy_refs(dfd: int, where: str, dst: Path, left: list[int]) -> None:
    dst.mkdir(exist_ok=True)
    for name in sorted(os.listdir(dfd)):
        left[0] -= 1
        if left[0] < 0:
            raise UntrustedGit(f"{where} holds too many refs to copy; run `git pack-refs --all` there")
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = _subdir(dfd, name, where)
            if sub is not None:
                try:
                    _copy_refs(sub, f"{where}/{name}", dst / name, left)
                finally:
                    os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            raw = read_file_at(dfd, name, where, 4096)
            if raw is not None and _OID.fullmatch(raw.strip()):
                (dst / name).write_bytes(raw)
        # symlinks (old-style symbolic refs) and anything else: not taken, never followed


def held(repo: KernelRepo, tree: str) -> bool:
    """Whether the kernel's repository holds the base tree `tree`."""
    return (repo.path / "HEAD").is_file() and repo.rev(f"{base_ref(tree)}^{{tree}}") == tree
