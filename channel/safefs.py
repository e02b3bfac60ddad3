"""Hostile-safe file I/O on agent-controlled directories: the only code that touches a channel.

The agent owns its workspace and runs concurrently with the kernel, so any name in `.syscall/` may at any moment
be a symlink, FIFO, hardlink, directory, sparse or growing file, or the channel itself may be swapped. Every
operation here therefore works on directory fds opened `O_DIRECTORY|O_NOFOLLOW`, takes single-component names
relative to them, opens with `O_NOFOLLOW` (and `O_NONBLOCK` for reads), decides on `fstat` of the open fd, and
never re-resolves a path string after a check. Writes never open an existing name: they go to a fresh
`O_EXCL` temp file that is renamed over the target, so a planted symlink or hardlink is replaced, not written
through. The one path string resolved is the kernel-trusted workspace path, and `Channel.check` re-verifies
what it leads to against the identity recorded at enrollment.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

from channel.decode import is_valid_id
from channel.limits import REQUEST_MAX_BYTES
from channel.paths import CHANNEL_DIR, ChannelPaths

# A file's (st_dev, st_ino).
Inode = tuple[int, int]

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening or reading a planted FIFO must not block a kernel thread. O_NOCTTY: a planted tty must
# not become our controlling terminal.
_READ_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_TEMP_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK: Final = 1 << 20
_NAME_MAX: Final = 255
# `_` is in no request id (ID_PATTERN), so no client temp in `requests/` (`.<id>.tmp`, 3.1) has this form: the
# kernel can remove its own leftovers there at start without touching a client's write in flight.
KERNEL_TEMP_PREFIX: Final = ".kernel_"
_TEMP_SUFFIX: Final = ".tmp"


class SafeFsError(Exception):
    """Base of the channel filesystem refusals (an `OSError` from the world is not one of these)."""


class ChannelMoved(SafeFsError):
    """The workspace or its channel is not the enrolled directory any more (gone, symlink, swapped, wrong owner)."""


class SubdirReplaced(ChannelMoved):
    """A channel subdirectory (`requests/`, `answers/`, ...) is not the directory recorded at enrollment."""


class Refused(SafeFsError):
    """A channel entry the kernel will not read, write or enter. `reason` is stable short text."""

    def __init__(self, reason: str, name: str | None = None) -> None:
        self.reason = reason
        self.name = name
        super().__init__(reason if name is None else f"{_shown(name)}: {reason}")


def _shown(name: str) -> str:
    """A name safe to put in a log line or message: escaped, never raw odd bytes, capped."""
    text = ascii(name)
    return text if len(text) <= 80 else text[:77] + "..."


def check_name(name: str) -> str:
    """Return `name` if it is a single path component, else raise ValueError saying what is wrong."""
    if not isinstance(name, str):
        raise ValueError(f"a file name must be a str, got {type(name).__name__}")
    if name in ("", ".", ".."):
        raise ValueError(f"file name {_shown(name)} is not a single path component")
    if "/" in name or "\0" in name:
        raise ValueError(f"file name {_shown(name)} contains '/' or NUL; only single components are allowed")
    try:
        encoded = os.fsencode(name)
    except UnicodeEncodeError:
        raise ValueError(f"file name {_shown(name)} cannot be encoded for the filesystem") from None
    if len(encoded) > _NAME_MAX:
        raise ValueError(f"file name {_shown(name)} is longer than {_NAME_MAX} bytes")
    return name


@dataclass(frozen=True, slots=True)
class Identity:
    """What enrollment records about a channel directory, to recognise it later."""

    dev: int
    ino: int
    uid: int
    # (name, dev, ino) of each subdirectory (ChannelPaths.SUBDIRS) as enrollment made or found it; () for a
    # channel recorded before they were (only their owner is checked then, until the next enrollment or start
    # records them).
    subdirs: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of_fd(cls, fd: int) -> Identity:
        st = os.fstat(fd)
        return cls(dev=st.st_dev, ino=st.st_ino, uid=st.st_uid)

    def same_directory(self, other: Identity) -> bool:
        """The same channel directory (dev, inode, owner), whatever is recorded of its subdirectories."""
        return (self.dev, self.ino, self.uid) == (other.dev, other.ino, other.uid)

    def differs_from(self, enrolled: Identity) -> bool:
        """Not what `enrolled` recorded: another channel directory, or (where recorded) another subdirectory."""
        return not self.same_directory(enrolled) or (
            bool(enrolled.subdirs) and self.subdirs != enrolled.subdirs
        )

    def subdir(self, name: str) -> tuple[int, int] | None:
        """The recorded (dev, inode) of subdirectory `name`, or None when not recorded."""
        for sub, dev, ino in self.subdirs:
            if sub == name:
                return dev, ino
        return None


def open_dir(path: str | os.PathLike[str]) -> int:
    """Open a kernel-trusted absolute directory path (final component not followed if a symlink)."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise ValueError(f"open_dir needs an absolute path, got {text!r}")
    return os.open(text, _DIR_FLAGS)


def _open_subdir_st(dir_fd: int, name: str, uid: int, shown_as: str) -> tuple[int, os.stat_result]:
    """Open `name` under `dir_fd` as a directory owned by `uid` (the fd and its stat), or raise Refused."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise Refused("missing", shown_as) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused("not a directory", shown_as) from None
        raise
    st = os.fstat(fd)
    if st.st_uid != uid:
        os.close(fd)
        raise Refused(f"owned by uid {st.st_uid}, not {uid}", shown_as)
    return fd, st


def _open_subdir(dir_fd: int, name: str, uid: int, shown_as: str) -> int:
    """Open `name` under `dir_fd` as a directory owned by `uid`, or raise Refused."""
    return _open_subdir_st(dir_fd, name, uid, shown_as)[0]


def _open_workspace(workspace: str) -> int:
    try:
        return open_dir(workspace)
    except OSError as e:
        raise ChannelMoved(f"workspace {workspace!r} cannot be opened as a directory: {e.strerror}") from None


def _open_channel_fd(workspace: str) -> int:
    ws_fd = _open_workspace(workspace)
    try:
        return os.open(CHANNEL_DIR, _DIR_FLAGS, dir_fd=ws_fd)
    except OSError as e:
        what = "is a symlink or not a directory" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
        raise ChannelMoved(f"{workspace}/{CHANNEL_DIR} {what}") from None
    finally:
        os.close(ws_fd)


def _open_enrolled_fd(workspace: str) -> int:
    """`_open_channel_fd` in one open of `<workspace>/.syscall` (not followed if a symlink), for a caller that
    then checks the directory against the identity enrollment recorded: whatever path led to it, a directory
    with that (device, inode, owner) is the enrolled channel. Any failure takes the two-step path, for its
    precise error."""
    if os.path.isabs(workspace):
        try:
            return os.open(os.path.join(workspace, CHANNEL_DIR), _DIR_FLAGS)
        except OSError:
            pass
    return _open_channel_fd(workspace)


def open_channel(
    workspace: str | os.PathLike[str], expected: Identity | None = None, *, create: bool = False
) -> Channel:
    """Open `<workspace>/.syscall` as a `Channel`.

    With `expected`, the directory must be the one enrolled (same dev, inode, owner), else ChannelMoved. Without
    it, the channel must be owned by this process's user: the kernel runs as the user who owns the workspaces,
    so a channel owned by anyone else was not made for us. `create=True` (enrollment, or repair) creates the
    channel and its subdirectories where missing; an existing subdirectory must be a real directory.
    """
    ws = os.fspath(workspace)
    if create:
        ws_fd = _open_workspace(ws)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(CHANNEL_DIR, 0o755, dir_fd=ws_fd)
        finally:
            os.close(ws_fd)
    fd = _open_channel_fd(ws) if expected is None or create else _open_enrolled_fd(ws)
    try:
        identity = Identity.of_fd(fd)
        if expected is not None and not identity.same_directory(expected):
            raise ChannelMoved(f"{ws}/{CHANNEL_DIR} is not the enrolled directory ({identity} != {expected})")
        if expected is None and identity.uid != os.geteuid():
            raise ChannelMoved(
                f"{ws}/{CHANNEL_DIR} is owned by uid {identity.uid}, not by us ({os.geteuid()})"
            )
        channel = Channel(ws, fd, identity if expected is None else expected)
    except BaseException:
        os.close(fd)
        raise
    if create:
        try:
            for sub in ChannelPaths.SUBDIRS:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(sub, 0o755, dir_fd=fd)
            # What enrollment finds is what it records (spec 2.3): later opens check each against it.
            channel.identity = dataclasses.replace(channel.identity, subdirs=channel.found_subdirs())
        except BaseException:
            channel.close()
            raise
    return channel


@dataclass(frozen=True, slots=True)
class RequestListing:
    """What `requests/` holds: committed ids, junk names (to remove), both sorted, and temp names (`.<x>.tmp`,
    unsorted)."""

    ids: list[str]
    junk: list[str]
    temps: list[str]


@dataclass(frozen=True, slots=True)
class TempSweep:
    """The outcome of `Channel.remove_stale_temps`: removed, left as too young, left as not removable."""

    removed: int
    young: int
    kept: int


class Channel:
    """An open channel directory fd, with every operation the kernel performs on it."""

    def __init__(self, workspace: str, fd: int, identity: Identity) -> None:
        self.workspace = workspace
        self._fd = fd
        self.identity = identity

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise ValueError("the channel is closed")
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def check(self) -> None:
        """Raise ChannelMoved unless `<workspace>/.syscall` still leads to this very directory."""
        fd = _open_channel_fd(self.workspace)
        try:
            now = Identity.of_fd(fd)
        finally:
            os.close(fd)
        if not now.same_directory(self.identity):
            raise ChannelMoved(
                f"{self.workspace}/{CHANNEL_DIR} was replaced ({now} is not the enrolled {self.identity})"
            )

    def subdir(self, name: str) -> int:
        """An fd of the direct subdirectory `name` (not followed if a symlink, same owner, and where enrollment
        recorded it, the very directory it recorded: else SubdirReplaced); the caller closes it."""
        fd, st = _open_subdir_st(self.fd, check_name(name), self.identity.uid, name)
        recorded = self.identity.subdir(name)
        if recorded is not None and (st.st_dev, st.st_ino) != recorded:
            os.close(fd)
            raise self._replaced(name, st, recorded)
        return fd

    def found_subdirs(self) -> tuple[tuple[str, int, int], ...]:
        """(name, dev, inode) of each subdirectory as it is now (owner checked, nothing followed)."""
        found = []
        for sub in ChannelPaths.SUBDIRS:
            fd = _open_subdir(self.fd, sub, self.identity.uid, sub)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            found.append((sub, st.st_dev, st.st_ino))
        return tuple(found)

    def check_subdirs(self) -> None:
        """Raise SubdirReplaced (or Refused) unless every recorded subdirectory is still the one recorded: one
        `fstatat` each (no symlink followed), the same judgement as `subdir` makes of the fd it opens."""
        for sub, dev, ino in self.identity.subdirs:
            try:
                st = os.stat(check_name(sub), dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                raise Refused("missing", sub) from None
            if not stat.S_ISDIR(st.st_mode):
                raise Refused("not a directory", sub)
            if st.st_uid != self.identity.uid:
                raise Refused(f"owned by uid {st.st_uid}, not {self.identity.uid}", sub)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise self._replaced(sub, st, (dev, ino))

    def _replaced(self, name: str, st: os.stat_result, recorded: tuple[int, int]) -> SubdirReplaced:
        return SubdirReplaced(
            f"{self.workspace}/{CHANNEL_DIR}/{name} was replaced since enrollment (device {st.st_dev}, "
            f"inode {st.st_ino}; enrolled: device {recorded[0]}, inode {recorded[1]}); this workspace "
            f"is not served and its requests are kept until the operator checks it and runs "
            f"`syscall-kernel enroll {self.workspace}` to adopt the new directory"
        )

    def list_requests(self) -> tuple[list[str], list[str]]:
        """(committed request ids, sorted; junk names to remove, sorted). In-flight temp files are neither."""
        listing = self.scan_requests()
        return listing.ids, listing.junk

    def scan_requests(self) -> RequestListing:
        """One listing of `requests/`: committed ids and junk names, each sorted, and temp names (`.<x>.tmp`) in
        directory order. Temps are split off first in one comprehension and never sorted: a channel holding
        100,000 of them must cost the kernel as little CPU (and GIL) as possible."""
        dfd = self.subdir(ChannelPaths.REQUESTS)
        try:
            names = os.listdir(dfd)
        finally:
            os.close(dfd)
        temps = [n for n in names if n.startswith(".") and n.endswith(".tmp")]
        ids: list[str] = []
        junk: list[str] = []
        if len(temps) != len(names):
            for name in names:
                if name.startswith(".") and name.endswith(".tmp"):
                    continue
                request_id = ChannelPaths.committed_request_id(name)
                if request_id is not None:
                    ids.append(request_id)
                else:
                    junk.append(name)
        return RequestListing(sorted(ids), sorted(junk), temps)

    def remove_stale_temps(self, names: Iterable[str], cutoff_ns: int) -> TempSweep:
        """Remove each temp name in `requests/` whose own mtime is at or before `cutoff_ns` (ns since the epoch).

        The age comes from `fstatat(AT_SYMLINK_NOFOLLOW)` of the entry itself, so a symlink is judged (and
        removed) as a link, never through its target; a directory is removed only if empty (an agent's tree is
        never walked); anything younger than the cutoff is not touched. Removal is by name right after the
        check: a client that follows the protocol never puts a fresh file under an existing temp name (O_EXCL,
        fresh ids), so the one window left is the agent racing itself. The caller bounds `names`.
        """
        batch = list(names)
        for name in batch:
            if not ChannelPaths.is_temp(check_name(name)):
                raise ValueError(f"{_shown(name)} is not a temp name (.<id>.tmp); only temps are aged out")
        removed = young = kept = 0
        dfd = self.subdir(ChannelPaths.REQUESTS)
        try:
            for name in batch:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if st.st_mtime_ns > cutoff_ns:
                    young += 1
                    continue
                try:
                    if stat.S_ISDIR(st.st_mode):
                        os.rmdir(name, dir_fd=dfd)
                    else:
                        os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    # Non-empty directory, or the entry changed kind since the check: left alone.
                    if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
                        kept += 1
                        continue
                    raise
                removed += 1
        finally:
            os.close(dfd)
        return TempSweep(removed=removed, young=young, kept=kept)

    def read_request(self, request_id: str, cap: int = REQUEST_MAX_BYTES) -> bytes:
        """The bytes of `requests/<id>.json`, at most `cap`; Refused for anything but a plain small file."""
        return self.read_request_entry(request_id, cap)[0]

    def read_request_entry(self, request_id: str, cap: int = REQUEST_MAX_BYTES) -> tuple[bytes, Inode]:
        """`read_request`, with the (device, inode) of the file read, for `remove_request(..., only=...)`."""
        if not is_valid_id(request_id):
            raise ValueError(f"{_shown(request_id)} is not a valid request id")
        dfd = self.subdir(ChannelPaths.REQUESTS)
        try:
            return read_capped_entry_at(dfd, ChannelPaths.request(request_id), cap)
        finally:
            os.close(dfd)

    def remove_request(self, name: str, only: Inode | None = None) -> None:
        """Remove `requests/<name>` (a file, or an empty directory); a name already gone is fine.

        With `only`, the entry is removed only while it is still that (device, inode): a client that renamed a
        new request over the name after the answer was written keeps it (it is read at the next listing).
        A non-empty directory is Refused rather than walked: deleting an agent-controlled tree safely is not
        worth it for junk.
        """
        check_name(name)
        dfd = self.subdir(ChannelPaths.REQUESTS)
        try:
            if only is None:
                _remove_at(dfd, name)
            else:
                _remove_if(dfd, name, only)
        finally:
            os.close(dfd)

    def write_file(
        self,
        subdir: str | None,
        name: str,
        data: bytes,
        mode: int = 0o644,
        *,
        durable: bool = True,
        shown_first: bool = False,
    ) -> None:
        """Atomically make `<subdir>/<name>` (or `<name>` in the channel itself) hold `data` (`durable=False`,
        `shown_first`: see `write_atomic_at`)."""
        if subdir is None:
            write_atomic_at(self.fd, name, data, mode, durable=durable, shown_first=shown_first)
            return
        dfd = self.subdir(subdir)
        try:
            write_atomic_at(dfd, name, data, mode, durable=durable, shown_first=shown_first)
        finally:
            os.close(dfd)

    def delivery_dir(self, components: tuple[str, ...]) -> int:
        """Create/open `results/<c1>/<c2>/...` one level at a time under the channel fd; the caller closes it.

        A level that is a symlink, a file, or owned by someone else is Refused, so nothing is written through it.
        """
        if not components:
            raise ValueError("delivery_dir needs at least one component under results/")
        for c in components:
            check_name(c)
        cur = self.subdir(ChannelPaths.RESULTS)
        shown = ChannelPaths.RESULTS
        try:
            for c in components:
                shown = f"{shown}/{c}"
                with contextlib.suppress(FileExistsError):
                    os.mkdir(c, 0o755, dir_fd=cur)
                nxt = _open_subdir(cur, c, self.identity.uid, shown)
                os.close(cur)
                cur = nxt
        except BaseException:
            os.close(cur)
            raise
        return cur


def _remove_if(dir_fd: int, name: str, only: Inode) -> None:
    """Unlink `name` only while it is the file `only`. A stat then an unlink would race a client that renames a
    new request over the name in between (the answer is visible before the request is removed, so a client
    that commits again at once lands right there) and delete that new request unanswered. So the entry is
    first moved aside under a kernel temp name (atomic: whatever is at the name then is what is judged), and
    put back where it is not `only`; `link` puts it back without replacing a still newer request at the name
    (which would have replaced it anyway). A kernel killed between the move and the put-back leaves the temp,
    removed at the next start (`sweep_kernel_temps`)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) != only:
        return  # the common case of a newer request: nothing moved
    aside = f"{KERNEL_TEMP_PREFIX}{secrets.token_hex(8)}{_TEMP_SUFFIX}"
    try:
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return
    moved = os.stat(aside, dir_fd=dir_fd, follow_symlinks=False)
    if (moved.st_dev, moved.st_ino) != only:
        try:
            os.link(aside, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            pass
        except (
            OSError
        ):  # no hard link here (a filesystem without them, protected_hardlinks): put it back by name
            os.rename(aside, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return
    os.unlink(aside, dir_fd=dir_fd)


def _remove_at(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise Refused("a non-empty directory", name) from None
            raise


def _entry(dir_fd: int, name: str) -> os.stat_result:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise Refused("vanished", name) from None


def read_capped_at(dir_fd: int, name: str, cap: int) -> bytes:
    """Read `dir_fd/name` if it is a regular, singly-linked file of at most `cap` bytes; else Refused."""
    return read_capped_entry_at(dir_fd, name, cap)[0]


def read_capped_entry_at(dir_fd: int, name: str, cap: int) -> tuple[bytes, Inode]:
    """`read_capped_at`, with the (device, inode) of the file read.

    `st_nlink == 1` alone does not prove the file lives only in this directory: the agent can link a foreign
    file in, let us open it, then unlink its own name, leaving the foreign name as the single link. So the
    name must lead to the opened inode both before the open and after the last `st_nlink == 1` check: at
    those instants the directory entry was the file's only link.
    """
    check_name(name)
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    # Also a pre-screen so that a FIFO or device is normally not even opened; the fstat after opening decides.
    pre = _entry(dir_fd, name)
    if stat.S_ISLNK(pre.st_mode):
        raise Refused("a symlink", name)
    if not stat.S_ISREG(pre.st_mode):
        raise Refused("not a regular file", name)
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise Refused("vanished", name) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused("a symlink", name) from None
        raise Refused(f"cannot be opened ({errno.errorcode.get(e.errno or 0, e.errno)})", name) from None
    try:
        data = read_capped_fd(fd, cap, name)
        opened = os.fstat(fd)
    finally:
        os.close(fd)
    post = _entry(dir_fd, name)
    inode = (opened.st_dev, opened.st_ino)
    if (pre.st_dev, pre.st_ino) != inode or (post.st_dev, post.st_ino) != inode:
        raise Refused("replaced while being read", name)
    return data, inode


def read_capped_fd(fd: int, cap: int, name: str | None = None) -> bytes:
    """Read an open file from its start: at most cap+1 bytes are ever read, whatever `st_size` says.

    Refused unless it is a regular file with one link, at most `cap` bytes, and unchanged while read.
    """
    before = os.fstat(fd)
    if not stat.S_ISREG(before.st_mode):
        raise Refused("not a regular file", name)
    if before.st_nlink == 0:
        raise Refused("vanished", name)
    if before.st_nlink != 1:
        # A hardlink may lead to a file outside the channel; reading it would make our errors an oracle.
        raise Refused(f"hardlinked (st_nlink={before.st_nlink})", name)
    os.lseek(fd, 0, os.SEEK_SET)
    chunks: list[bytes] = []
    total = 0
    while total <= cap:
        chunk = os.read(fd, min(cap + 1 - total, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > cap:
        raise Refused(f"larger than {cap} bytes", name)
    after = os.fstat(fd)
    if (after.st_size, after.st_mtime_ns, after.st_nlink) != (before.st_size, before.st_mtime_ns, 1) or (
        total != after.st_size
    ):
        raise Refused("changed while being read", name)
    return b"".join(chunks)


def _new_temp(dir_fd: int) -> tuple[str, int]:
    for _ in range(16):
        tmp = f"{KERNEL_TEMP_PREFIX}{secrets.token_hex(8)}{_TEMP_SUFFIX}"
        try:
            return tmp, os.open(tmp, _TEMP_FLAGS, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "could not create a unique temp file (16 random names taken)")


def _commit(dir_fd: int, tmp: str, name: str, durable: bool = True) -> None:
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
            raise Refused("a directory is in the way", name) from None
        raise
    if durable:
        os.fsync(dir_fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _discard(dir_fd: int, tmp: str) -> None:
    with contextlib.suppress(OSError):  # the original failure is what the caller needs to see
        os.unlink(tmp, dir_fd=dir_fd)


def write_atomic_at(
    dir_fd: int, name: str, data: bytes, mode: int = 0o644, *, durable: bool = True, shown_first: bool = False
) -> None:
    """Make `dir_fd/name` hold `data`: a random O_EXCL temp, fchmod, write, fsync, rename, fsync of the dir.

    Whatever was at `name` (a symlink, a hardlink to a victim) is replaced, never written through. On any failure
    the temp file is removed and the old `name` is untouched. `durable=False` leaves out both fsyncs: the caller
    makes many writes durable at once with `sync_filesystem` before it relies on them.

    `shown_first=True` renames before the two fsyncs (the file's, through a second, read-only descriptor, then the
    directory's), so a reader sees the file a disk flush sooner; it is durable when the call returns, as without
    it. The writing descriptor is closed before the rename, so nothing is ever written or closed-after-writing
    under the final name (a client watching inotify sees only the rename, spec 2.4). Only for a file the kernel
    can write again from its own durable record should a power cut leave it torn (an answer: its request is
    removed only after this returns, and the next start replays the recorded answer over it).
    """
    check_name(name)
    tmp, fd = _new_temp(dir_fd)
    reader = -1
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
            if shown_first and durable:
                reader = _reopen_readonly(fd)
            if durable and reader < 0:
                os.fsync(fd)
        finally:
            os.close(fd)
        if reader < 0:
            _commit(dir_fd, tmp, name, durable)
            return
        _commit(dir_fd, tmp, name, durable=False)
        os.fsync(reader)
        os.fsync(dir_fd)
    except BaseException:
        _discard(dir_fd, tmp)
        raise
    finally:
        if reader >= 0:
            os.close(reader)


def _reopen_readonly(fd: int) -> int:
    """A read-only descriptor of the file open as `fd` (a new open of the same inode through /proc, which fsync
    accepts); -1 where /proc is not mounted (the caller then fsyncs before the rename)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def copy_atomic_at(
    dir_fd: int, name: str, src_fd: int, limit: int, mode: int = 0o644, *, offset: int = 0
) -> tuple[int, str]:
    """Stream the regular file `src_fd` (from `offset`) into `dir_fd/name` atomically; return (size, sha256 hex).

    Refused if the source is not a regular file or holds more than `limit` bytes after `offset` (checked while
    streaming, not from `st_size`, since the source may still be growing); nothing is left behind then.
    """
    check_name(name)
    if limit < 0 or offset < 0:
        raise ValueError(f"limit and offset must be >= 0, got {limit} and {offset}")
    st = os.fstat(src_fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused("source is not a regular file", name)
    if st.st_size - offset > limit:
        raise Refused(f"larger than {limit} bytes", name)
    digest = hashlib.sha256()
    size = 0
    tmp, fd = _new_temp(dir_fd)
    try:
        try:
            os.fchmod(fd, mode)
            while True:
                chunk = os.pread(src_fd, min(_CHUNK, limit + 1 - size), offset + size)
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise Refused(f"larger than {limit} bytes", name)
                digest.update(chunk)
                _write_all(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        _commit(dir_fd, tmp, name)
    except BaseException:
        _discard(dir_fd, tmp)
        raise
    return size, digest.hexdigest()


def sync_filesystem(fd: int) -> None:
    """Make every write to the filesystem holding `fd` durable, renames included (syncfs(2); os.sync where
    syncfs is not available): one call for many `durable=False` writes instead of two fsyncs each."""
    if _syncfs is None:
        os.sync()
        return
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        fn: Callable[[int], int] = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    return fn


_syncfs: Final = _load_syncfs()


def kernel_temps(names: Iterable[str]) -> list[str]:
    """The names among `names` that are this module's temp files (left behind only if the kernel was killed)."""
    return [
        n
        for n in names
        if n.startswith(KERNEL_TEMP_PREFIX)
        and n.endswith(_TEMP_SUFFIX)
        and len(n) == len(KERNEL_TEMP_PREFIX) + 16 + len(_TEMP_SUFFIX)
    ]


def sweep_kernel_temps(dir_fd: int, before_ns: int | None = None) -> int:
    """Remove the kernel's own leftover temp files in `dir_fd` (call once at startup); return how many. With
    `before_ns`, only those last modified before it (the start of this process: a temp of a write in progress
    now is not a leftover)."""
    stale = kernel_temps(os.listdir(dir_fd))
    removed = 0
    for tmp in stale:
        if before_ns is not None:
            try:
                if os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns >= before_ns:
                    continue
            except OSError:
                continue
        _discard(dir_fd, tmp)
        removed += 1
    return removed
