"""A proof, from the bytes of a git index alone, that it tracks nothing at or under one top-level name.

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
