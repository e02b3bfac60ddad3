"""kernel.core.gitindex against indexes real git wrote: it settles only what it can prove (nothing tracked at or
under the name) and sends everything else to git; enrollment's tracked-channel check agrees with git either way."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from kernel.core.gitindex import entry_count, shared_index_id, surely_untracked
from kernel.io.enroll import EnrollError, check_workspace
from kernel.io.snapshot import tracked_under

ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def git(ws: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(ws), *args], check=True, env=ENV, capture_output=True)


def repo(tmp_path: Path, *files: str, version: int | None = None) -> Path:
    ws = tmp_path / "ws"
    git(tmp_path, "init", "-q", str(ws))
    if version is not None:
        git(ws, "config", "index.version", str(version))
    for name in files:
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text(name)
        git(ws, "add", "-f", name)
    return ws


def index_of(ws: Path) -> bytes:
    return (ws / ".git" / "index").read_bytes()


@pytest.mark.parametrize("version", [2, 3])
def test_a_v2_or_v3_index_without_the_name_is_settled(tmp_path: Path, version: int) -> None:
    ws = repo(tmp_path, "train.py", "src/model.py")
    if version == 3:  # git writes version 3 only for entries with extended flags, e.g. intent-to-add
        (ws / "later.py").write_text("x")
        git(ws, "add", "-N", "later.py")
    data = index_of(ws)
    assert int.from_bytes(data[4:8], "big") == version
    assert surely_untracked(data, ".syscall")


def test_no_index_tracks_nothing() -> None:
    assert surely_untracked(None, ".syscall")


@pytest.mark.parametrize("tracked", [".syscall/x", ".syscall"])
def test_an_index_with_the_name_is_never_settled(tmp_path: Path, tracked: str) -> None:
    ws = repo(tmp_path, "train.py", tracked)
    assert not surely_untracked(index_of(ws), ".syscall")
    assert tracked_under(str(ws), ".syscall") == [tracked]  # git, asked instead, finds it


def test_a_v4_index_is_left_to_git_even_without_the_name(tmp_path: Path) -> None:
    # Version 4 compresses each path against the previous one: ".s" then "yscall/x" never spells the name.
    ws = repo(tmp_path, ".s", ".syscall/x", version=4)
    data = index_of(ws)
    assert b".syscall" not in data  # the trap a byte search would fall into
    assert not surely_untracked(data, ".syscall")
    assert tracked_under(str(ws), ".syscall") == [".syscall/x"]


def test_a_split_index_is_left_to_git(tmp_path: Path) -> None:
    ws = repo(tmp_path, "train.py")
    git(ws, "update-index", "--split-index")
    (ws / ".syscall").mkdir()
    (ws / ".syscall" / "x").write_text("x")
    git(ws, "add", "-f", ".syscall/x")
    assert not surely_untracked(index_of(ws), ".syscall")
    assert tracked_under(str(ws), ".syscall") == [".syscall/x"]


def test_a_forged_index_whose_hash_does_not_match_is_left_to_git(tmp_path: Path) -> None:
    ws = repo(tmp_path, "train.py")
    data = bytearray(index_of(ws))
    data[-1] ^= 0xFF
    assert not surely_untracked(bytes(data), ".syscall")
    body = bytes(data[:-20])
    assert surely_untracked(body + hashlib.sha1(body).digest(), ".syscall")  # what git itself would accept
    (ws / ".syscall").mkdir()
    (ws / ".syscall" / "x").write_text("x")
    git(ws, "add", "-f", ".syscall/x")
    data = bytearray(index_of(ws))
    data[-1] ^= 0xFF
    (ws / ".git" / "index").write_bytes(bytes(data))
    with pytest.raises(EnrollError, match="tracks 1 file"):
        check_workspace(str(ws))  # settled by git, which reads it


def test_enrollment_refuses_a_tracked_channel_and_accepts_the_rest(tmp_path: Path) -> None:
    ws = repo(tmp_path, "train.py", ".syscall/tool")
    with pytest.raises(EnrollError, match="tracks 1 file"):
        check_workspace(str(ws))
    git(ws, "rm", "-q", "--cached", ".syscall/tool")
    assert check_workspace(str(ws)) == str(ws.resolve())


# --- entry_count and shared_index_id (issue 23: the header and the link extension, read before git) -------------


@pytest.mark.parametrize("version", [2, 3, 4])
def test_the_header_count_and_the_named_shared_index_match_what_git_wrote(
    tmp_path: Path, version: int
) -> None:
    names = ["a.txt", "d/" + "/".join(["y" * 100] * 3), "d/f.py", "z"]
    ws = repo(tmp_path, *names, version=version)
    if version == 3:
        (ws / "later.py").write_text("x")
        git(ws, "add", "-N", "later.py")  # an entry with extended flags (2 more bytes before its name)
    git(ws, "update-index", "--split-index")
    (ws / "z").write_text("changed")
    git(ws, "add", "z")  # an entry in the split index itself, beside the shared one's
    data = index_of(ws)
    [shared] = (ws / ".git").glob("sharedindex.*")
    versions = {int.from_bytes(d[4:8], "big") for d in (data, shared.read_bytes())}
    assert max(versions) == version  # (the extended entry may sit in the shared index only)
    assert shared_index_id(data) == shared.name.removeprefix("sharedindex.")
    assert entry_count(shared.read_bytes()) == len(names) + (version == 3)
    assert shared_index_id(shared.read_bytes()) is None  # the shared index has no link of its own


def test_an_index_without_a_link_names_no_shared_index(tmp_path: Path) -> None:
    ws = repo(tmp_path, "link", "links/link.txt")  # the bytes `link` in paths are not the extension
    data = index_of(ws)
    assert entry_count(data) == 2
    assert shared_index_id(data) is None


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"DIRC",
        b"XXXX\0\0\0\2\0\0\0\1",
        b"DIRC\0\0\0\5\0\0\0\1",
        b"DIRC\0\0\0\2\xff\xff\xff\xfflink" + bytes(40),
    ],
)
def test_what_is_not_an_index_names_nothing(data: bytes) -> None:
    assert shared_index_id(data) is None
    assert entry_count(data) is None or data[8:12] == b"\xff\xff\xff\xff"


def test_the_count_is_the_headers_without_reading_on() -> None:
    assert entry_count(b"DIRC\0\0\0\2" + (3_000_000).to_bytes(4, "big")) == 3_000_000
