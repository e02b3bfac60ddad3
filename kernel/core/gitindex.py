"""What the kernel reads from the bytes of a git index alone, before git is given a copy of it.

- `entry_count`: how many entries the index's 12-byte header declares, so a snapshot past its file limit is
  refused before the entries are read, copied or parsed by git.
- `shared_index_id`: which `sharedindex.<id>` a split index's `link` extension names (the only other file git
  reads for it), so the kernel copies that one file and never any other the agent planted beside it.
- `surely_untracked`: a proof that the index tracks nothing at or under one top-level name.

Enrollment must refuse a workspace whose index tracks `.syscall/` (the channel must never be committed). Asking
git (`ls-files` on a kernel-owned copy of the index) costs a process per workspace, which 10,000 first-time
enrollments cannot afford. Most indexes can be settled from their bytes: in index versions 2 and 3 every entry
stores its full path literally, so an index whose bytes nowhere contain the name tracks no path that is the name
or starts with it. Whatever this module cannot settle (version 4 compresses paths against the previous entry; a
split index keeps entries in another file; a hash that does not match; anything unexpected) answers "not
proven", and the caller asks git as before. Pure: bytes in, a bool out.
"""

from __future__ import annotations

import hashlib
from typing import Final

_SIGNATURE: Final = b"DIRC"
_HEADER: Final = 12
_SHA1: Final = 20
# An entry's fixed part (ctime, mtime, dev, ino, mode, uid, gid, size: 4 bytes each; the object id; the flags).
_ENTRY_FIXED: Final = 40 + _SHA1 + 2
_NAME_MASK: Final = 0x0FFF
_EXTENDED: Final = 0x4000


def entry_count(header: bytes) -> int | None:
    """The number of entries a git index's header (its first 12 bytes: `DIRC`, version, count) declares; None
    when `header` is not one (git refuses such a file itself). git allocates and parses that many entries, so
    the count bounds its work on the file (a conflicted path is one entry per stage)."""
    if len(header) < _HEADER or header[:4] != _SIGNATURE:
        return None
    if int.from_bytes(header[4:8], "big") not in (2, 3, 4):
        return None
    return int.from_bytes(header[8:12], "big")


def _varint(data: bytes, at: int) -> int:
    """The offset past git's offset-varint at `at` (index version 4's prefix length)."""
    while data[at] & 0x80:
        at += 1
    return at + 1


def _entries_end(index: bytes, version: int, count: int) -> int:
    """The offset where the entries of `index` end and its extensions begin (IndexError past the end)."""
    at = _HEADER
    for _ in range(count):
        flags = int.from_bytes(index[at + _ENTRY_FIXED - 2 : at + _ENTRY_FIXED], "big")
        name = at + _ENTRY_FIXED + (2 if version >= 3 and flags & _EXTENDED else 0)
        if version == 4:
            name = _varint(index, name)
        end = index.index(b"\0", name)  # the name is NUL-terminated in every version
        at = end + 1 if version == 4 else at + ((end - at) // 8 + 1) * 8
    if at > len(index) - _SHA1:
        raise IndexError(at)
    return at


def shared_index_id(index: bytes) -> str | None:
    """The id (hex) of the shared index that a split index's `link` extension names; None when `index` has no
    link extension (or names the null id: no shared index), or is not an index this module can walk (git then
    refuses the copy itself, never reading a shared index the kernel did not copy).

    Sound because git reads exactly `<git dir>/sharedindex.<that id>` for a split index and no other shared
    index, and the entries are walked as git lays them out (versions 2 and 3: padded to 8 bytes; version 4:
    prefix-compressed, unpadded; every name NUL-terminated)."""
    count = entry_count(index)
    if count is None or b"link" not in index:
        return None
    version = int.from_bytes(index[4:8], "big")
    try:
        at = _entries_end(index, version, count)
        while at + 8 <= len(index) - _SHA1:
            sig, size = index[at : at + 4], int.from_bytes(index[at + 4 : at + 8], "big")
            if sig == b"link" and size >= _SHA1:
                oid = index[at + 8 : at + 8 + _SHA1]
                return None if oid == bytes(_SHA1) else oid.hex()
            at += 8 + size
    except (IndexError, ValueError):
        return None
    return None


def surely_untracked(index: bytes | None, name: str) -> bool:
    """True only when `index` (a git index file's bytes; None: no index, nothing tracked) provably has no entry
    `name` or `name/...`. False means "ask git", never "tracked".

    Sound because, for a version 2 or 3 index whose SHA-1 trailer matches (what git itself checks before it
    reads one): each entry's path is stored whole, so an entry for `name` or under it contains the bytes of
    `name`; the index has no `link` extension (split index: entries stored elsewhere) when the bytes `link`
    occur nowhere (a false alarm only sends the caller to git); a sparse index's directory entries are paths
    too. Version 4 (prefix-compressed paths) and a SHA-256 repository's index are never settled here."""
    if index is None:
        return True
    if len(index) < _HEADER + _SHA1 or index[:4] != _SIGNATURE:
        return False
    version = int.from_bytes(index[4:8], "big")
    if version not in (2, 3):
        return False
    if hashlib.sha1(index[:-_SHA1], usedforsecurity=False).digest() != index[-_SHA1:]:
        return False
    return name.encode() not in index and b"link" not in index
