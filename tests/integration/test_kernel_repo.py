"""kernel.io.repo against real git: the verified base import, reads of a held base, retention."""

from __future__ import annotations

import os
import subprocess
import zlib
from pathlib import Path

import anyio
import pytest
from kernelproc import PLAIN_GIT, plain_git

from kernel.io import repo as R
from kernel.io import snapshot as S


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    plain_git(ws, "init", "-q", "-b", "main")
    (ws / "eval.py").write_text("print(0.5)\n")
    (ws / "pkg").mkdir()
    (ws / "pkg" / "lib.py").write_text("X = 1\n")
    (ws / "run.sh").write_text("#!/bin/sh\n")
    (ws / "run.sh").chmod(0o755)
    (ws / "link").symlink_to("eval.py")
    plain_git(ws, "add", "-A")
    plain_git(ws, "commit", "-qm", "base")
    return ws


@pytest.fixture
def repo(tmp_path: Path) -> R.KernelRepo:
    r = R.KernelRepo.at(tmp_path / "run", "ws-0123456789")
    r.ensure()
    return r


def take(repo: R.KernelRepo, ws: Path, rev: str = "HEAD") -> R.Base | None:
    return R.import_base(repo, ws, rev, tmp_dir=ws.parent / "ktmp")


def test_a_base_is_imported_with_the_agents_ids_and_read_back(ws: Path, repo: R.KernelRepo) -> None:
    base = take(repo, ws)
    assert base == R.Base(plain_git(ws, "rev-parse", "HEAD"), plain_git(ws, "rev-parse", "HEAD^{tree}"))
    assert R.held(repo, base.tree)
    assert repo.read_blob(base.tree, "pkg/lib.py") == b"X = 1\n"
    assert repo.read_blob(base.tree, "missing") is None
    assert {(e.path, e.mode) for e in repo.list_tree(base.tree)} == {
        ("eval.py", "100644"),
        ("pkg/lib.py", "100644"),
        ("run.sh", "100755"),
        ("link", "120000"),
    }
    # A branch, a tag, a packed ref and a full id resolve against the copy of the agent's refs.
    plain_git(ws, "tag", "v1")
    plain_git(ws, "branch", "side")
    plain_git(ws, "pack-refs", "--all")
    for rev in ("main", "v1", "side", "HEAD", base.commit):
        assert take(repo, ws, rev) == base
    assert "syscall" not in plain_git(ws, "for-each-ref")


def test_a_repository_without_commits_has_no_base(tmp_path: Path, repo: R.KernelRepo) -> None:
    ws = tmp_path / "empty"
    ws.mkdir()
    plain_git(ws, "init", "-q")
    assert take(repo, ws) is None


def test_a_loose_object_rewritten_in_place_is_refused_naming_the_file(ws: Path, repo: R.KernelRepo) -> None:
    oid = plain_git(ws, "rev-parse", "HEAD:pkg/lib.py")
    path = ws / ".git" / "objects" / oid[:2] / oid[2:]
    path.chmod(0o644)
    path.write_bytes(zlib.compress(b"blob 6\0X = 9\n"))
    assert plain_git(ws, "cat-file", "blob", oid) == "X = 9"  # git itself serves the forgery
    with pytest.raises(
        R.ObjectMismatch, match=r"'pkg/lib\.py' \(blob [0-9a-f]{40}\) does not hash to its id"
    ):
        take(repo, ws)


def test_a_tree_or_commit_rewritten_in_place_is_refused(ws: Path, repo: R.KernelRepo) -> None:
    commit = plain_git(ws, "rev-parse", "HEAD")
    path = ws / ".git" / "objects" / commit[:2] / commit[2:]
    path.chmod(0o644)
    body = zlib.decompress(path.read_bytes()).replace(b"base", b"fake")
    path.write_bytes(zlib.compress(body))
    with pytest.raises(R.ObjectMismatch, match="the base commit 'HEAD'"):
        take(repo, ws)


def test_links_in_git_are_refused_with_their_path(ws: Path, repo: R.KernelRepo, tmp_path: Path) -> None:
    dot = ws / ".git"
    (dot / "refs").rename(tmp_path / "refs")
    (dot / "refs").symlink_to(tmp_path / "refs")
    with pytest.raises(R.UntrustedGit, match=r"\.git/refs is a symlink or not a directory"):
        take(repo, ws)
    (dot / "refs").unlink()
    (tmp_path / "refs").rename(dot / "refs")
    (dot / "objects").rename(tmp_path / "objects")
    (dot / "objects").symlink_to(tmp_path / "objects")
    with pytest.raises(R.UntrustedGit, match=r"\.git/objects is a symlink"):
        take(repo, ws)
    (dot / "objects").unlink()
    (tmp_path / "objects").rename(dot / "objects")
    plain_git(ws, "pack-refs", "--all")
    (dot / "packed-refs").rename(tmp_path / "packed-refs")
    (dot / "packed-refs").symlink_to(tmp_path / "packed-refs")
    with pytest.raises(R.UntrustedGit, match=r"packed-refs is a symlink"):
        take(repo, ws, "main")


def test_alternates_are_never_taken(ws: Path, repo: R.KernelRepo, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    plain_git(other, "init", "-q")
    (other / "secret.txt").write_text("other workspace\n")
    plain_git(other, "add", "-A")
    plain_git(other, "commit", "-qm", "o")
    (ws / ".git" / "objects" / "info" / "alternates").write_text(f"{other / '.git' / 'objects'}\n")
    with pytest.raises(R.UntrustedGit, match="is missing"):
        take(repo, ws, plain_git(other, "rev-parse", "HEAD"))


def test_held_bases_survive_gc_and_released_snapshots_go(
    ws: Path, repo: R.KernelRepo, tmp_path: Path
) -> None:
    base = take(repo, ws)
    assert base is not None
    (ws / "eval.py").write_text("print(0.9)\n")
    snap = anyio.run(lambda: S.take_snapshot(ws, repo, 7, tmp_dir=tmp_path / "ktmp"))
    blob = repo.list_tree(snap.tree)[0].oid
    S.release_sync(repo, 7)
    repo.gc(prune="now")
    assert R.held(repo, base.tree)
    assert repo.read_blob(base.tree, "eval.py") == b"print(0.5)\n"
    gone = subprocess.run(["git", "--git-dir", str(repo.path), "cat-file", "-e", blob], env=PLAIN_GIT)
    assert gone.returncode != 0
    assert not repo.gc_due(3600)  # just stamped


def test_legacy_refs_are_named_never_followed(ws: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "k").mkdir(parents=True)
    (ws / ".git" / "refs" / "syscall").symlink_to(outside)
    fd = R.open_dot_git(ws)
    try:
        assert R.legacy_refs(fd) == ["refs/syscall (a symlink, not followed)"]
    finally:
        os.close(fd)
    (ws / ".git" / "refs" / "syscall").unlink()
    plain_git(ws, "update-ref", "refs/syscall/k/base", "HEAD")
    plain_git(ws, "update-ref", "refs/syscall/k/4", "HEAD")
    (ws / ".git" / "refs" / "syscall" / "k" / "5").symlink_to(outside / "k")
    fd = R.open_dot_git(ws)
    try:
        assert R.legacy_refs(fd) == [
            "refs/syscall/k/4",
            "refs/syscall/k/5 (a symlink, not followed)",
            "refs/syscall/k/base",
        ]
    finally:
        os.close(fd)
    (ws / ".git" / "refs" / "syscall" / "k" / "5").unlink()
    (ws / ".git" / "refs" / "syscall" / "k" / "4").unlink()
    plain_git(ws, "pack-refs", "--all")
    fd = R.open_dot_git(ws)
    try:
        assert R.legacy_refs(fd) == ["refs/syscall/k/base"]
    finally:
        os.close(fd)


def test_pure_helpers() -> None:
    assert R.object_id("blob", b"hi\n") == "45b983be36b73c0788dc9cbcb76cbb80fc7bb057"
    tree = b"100644 a\0" + bytes(20) + b"40000 d\0" + b"\x01" * 20
    assert R.parse_tree(tree) == [("100644", b"a", "00" * 20), ("40000", b"d", "01" * 20)]
    with pytest.raises(ValueError, match="truncated"):
        R.parse_tree(b"100644 a\0" + bytes(5))
    assert R.snapshot_ref(3) == "refs/snapshots/3"
    with pytest.raises(ValueError, match="not a tree id"):
        R.base_ref("HEAD")


def test_a_sha256_repository_is_verified_with_sha256(tmp_path: Path, repo: R.KernelRepo) -> None:
    ws = tmp_path / "ws256"
    ws.mkdir()
    plain_git(ws, "init", "-q", "--object-format=sha256")
    (ws / "a.txt").write_text("a\n")
    plain_git(ws, "add", "-A")
    plain_git(ws, "commit", "-qm", "one")
    base = take(repo, ws)
    assert base is not None
    assert len(base.commit) == 64
    assert base.commit == plain_git(ws, "rev-parse", "HEAD")
    assert repo.read_blob(base.tree, "a.txt") == b"a\n"
    (ws / "b.txt").write_text("b\n")
    snap = S.snapshot_sync(ws, repo, 1, tmp_dir=tmp_path / "ktmp")
    assert {e.path for e in repo.list_tree(snap.tree)} == {"a.txt", "b.txt"}
    oid = plain_git(ws, "rev-parse", "HEAD:a.txt")
    loose = ws / ".git" / "objects" / oid[:2] / oid[2:]
    loose.chmod(0o644)
    loose.write_bytes(zlib.compress(b"blob 2\0z\n"))
    with pytest.raises(R.ObjectMismatch, match=r"'a\.txt'"):
        take(repo, ws)
