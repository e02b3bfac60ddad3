"""The job wrapper's tree walks hold a bounded number of fds whatever the tree, and the scorer's copy of a tree
holds regular files and directories only (kernel.node.wrapper: materialise, DirChain, copy_for_scorer).

Materialising reads a real kernel repository (a snapshot taken by kernel.io.snapshot); the fd bound is checked
under a real RLIMIT_NOFILE: on a wrapper that keeps one fd per directory, 1,500 directories at 1,024 fds fail
with EMFILE (`materialise_failed` on every job)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from test_local_backend import exits, make_world, result, text, with_backend

from kernel.backends import jobscript
from kernel.io.repo import neutral_env
from kernel.node import wrapper as W


@contextlib.contextmanager
def fd_limit(n: int) -> Iterator[None]:
    """This process (and what it starts meanwhile) may hold at most `n` fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def wide(n: int) -> dict[str, str]:
    return {f"d{i:04d}/f.txt": f"{i}\n" for i in range(n)}


def deep(n: int) -> dict[str, str]:
    return {"/".join(["d"] * n) + "/leaf.txt": "bottom\n", "d/top.txt": "top\n"}


def git_of(w: object, root: Path) -> dict[str, object]:
    repo = root / "runs" / "repos" / "ws-test.git"
    return {"repo": str(repo), "tree": w.snap.tree, "env": neutral_env(str(repo))}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("files", "limit"), [(wide(1500), 1024), (deep(60), 128)], ids=["1500-dirs", "60-deep"]
)
def test_materialise_holds_a_bounded_number_of_fds(tmp_path: Path, files: dict[str, str], limit: int) -> None:
    w = make_world(tmp_path, files)
    tree, scratch = tmp_path / "tree", tmp_path / "mat"
    tree.mkdir()
    scratch.mkdir()
    with fd_limit(limit):
        written = W.materialise(git_of(w, tmp_path), str(tree), str(scratch))
    assert written == len(files) + 1  # make_world's dirty.txt
    for rel, body in files.items():
        assert (tree / rel).read_text() == body
    # and the scorer's copy of that tree, under the same limit
    view = tmp_path / "view"
    view.mkdir()
    with fd_limit(limit):
        assert W.copy_for_scorer(str(tree), str(view)) == ([], 0)
    for rel, body in files.items():
        assert (view / rel).read_text() == body


def test_a_job_on_a_tree_with_more_directories_than_its_fds_runs(tmp_path: Path) -> None:
    w = make_world(tmp_path, wide(1500))
    spec = w.spec("wide", "ls | wc -l; cat d1499/f.txt")

    async def go(b: object) -> None:
        await b.submit(spec)  # type: ignore[attr-defined]
        await exits(b, 1)  # type: ignore[arg-type]

    with fd_limit(1024):  # the wrapper inherits it
        with_backend(go)
    assert (result(spec).kind, result(spec).code) == ("exited", 0), text(spec, "stderr")
    assert text(spec, "stdout") == "1501\n1499\n"  # and dirty.txt


def test_the_scorers_copy_of_a_tree_deeper_than_its_fds(tmp_path: Path) -> None:
    """A job may leave a tree far deeper than a snapshot may be (the snapshot's limit is 64 directories)."""
    tree, view = tmp_path / "tree", tmp_path / "view"
    view.mkdir()
    tree.mkdir()
    fd = os.open(tree, W._O_DIR)
    for _ in range(300):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", W._O_DIR, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    with fd_limit(128):
        assert W.copy_for_scorer(str(tree), str(view)) == ([], 0)
    fd = os.open(view, W._O_DIR)
    try:
        for _ in range(300):
            nfd = os.open("d", W._O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        assert os.listdir(fd) == ["leaf"]
    finally:
        os.close(fd)


def test_dir_chain_reopens_past_its_cap_and_never_follows_a_symlink(tmp_path: Path) -> None:
    root = os.open(tmp_path, W._O_DIR)
    chain = W.DirChain(root, create=True, cap=3)
    try:
        fd = chain.at(["a", "b", "c", "d", "e"])
        os.close(os.open("x", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        assert (tmp_path / "a/b/c/d/e/x").is_file()
        assert len(chain.fds) == 3
        assert chain.deep is not None
        assert chain.at(["a", "b", "c", "d", "f"]) != root
        assert (tmp_path / "a/b/c/d/f").is_dir()
        assert chain.at([]) == root
        assert (chain.fds, chain.deep) == ([], None)
        (tmp_path / "link").symlink_to(tmp_path / "a")
        with pytest.raises(OSError, match=r"Not a directory|Too many levels"):
            chain.at(["link", "b"])
    finally:
        chain.close()
        os.close(root)


def test_the_scorers_copy_holds_regular_files_and_directories_only(tmp_path: Path) -> None:
    tree, view, outside = tmp_path / "tree", tmp_path / "view", tmp_path / "outside.txt"
    for d in (tree / "sub" / "empty", view):
        d.mkdir(parents=True)
    outside.write_text("labels\n")
    (tree / "answer.txt").symlink_to("/proc/self/fd/3")
    (tree / "sub" / "dirlink").symlink_to(tmp_path)
    os.mkfifo(tree / "pipe")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tree / "sock"))
    os.link(outside, tree / "sub" / "hard.txt")  # another name of this file lies outside the tree
    (tree / "kept.txt").write_text("kept\n")
    os.link(tree / "kept.txt", tree / "sub" / "same.txt")  # both names inside: copied
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod(0o700)
    (tree / "odd\nname").write_text("x")
    unseen, count = W.copy_for_scorer(str(tree), str(view))
    assert sorted((u["path"], u["why"]) for u in unseen) == [
        ("answer.txt", "a symbolic link"),
        ("pipe", "a FIFO (named pipe)"),
        ("sock", "a socket"),
        ("sub/dirlink", "a symbolic link"),
        ("sub/hard.txt", "a hard link to a file outside the tree"),
    ]
    assert count == 5
    found = sorted(str(p.relative_to(view)) for p in view.rglob("*"))
    assert found == ["kept.txt", "odd\nname", "run.sh", "sub", "sub/empty", "sub/same.txt"]
    assert all(not p.is_symlink() for p in view.rglob("*"))
    assert stat.S_IMODE((view / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((view / "kept.txt").stat().st_mode) == 0o644
    assert (view / "sub" / "same.txt").read_text() == "kept\n"
    assert (view / "kept.txt").stat().st_ino != (tree / "kept.txt").stat().st_ino


def test_the_scorers_copy_names_the_first_paths_and_counts_them_all(tmp_path: Path) -> None:
    tree, view = tmp_path / "tree", tmp_path / "view"
    tree.mkdir()
    view.mkdir()
    for i in range(W.UNSEEN_KEPT + 7):
        (tree / f"l{i:03d}").symlink_to("nowhere")
    unseen, count = W.copy_for_scorer(str(tree), str(view))
    assert (len(unseen), count) == (W.UNSEEN_KEPT, W.UNSEEN_KEPT + 7)
    assert unseen[0] == {"path": "l000", "why": "a symbolic link"}


def test_the_exit_record_carries_what_the_scorer_did_not_see() -> None:
    """The kernel's ExitRecord reads the fields the wrapper writes about the copy."""
    rec = W.exit_record(
        W.KIND_EXITED,
        0,
        score_code=0,
        score_unseen=[{"path": "a", "why": "a symbolic link"}],
        score_unseen_count=1,
    )
    got = msgspec.json.decode(json.dumps(rec), type=jobscript.ExitRecord)
    assert (got.score_unseen[0].path, got.score_unseen_count) == ("a", 1)


def test_a_sparse_file_costs_the_scorers_copy_only_its_data(tmp_path: Path) -> None:
    """A job can leave a file of 1 TiB that holds 4 KiB of data: the copy keeps the holes."""
    tree, view = tmp_path / "tree", tmp_path / "view"
    tree.mkdir()
    view.mkdir()
    with open(tree / "big", "wb") as f:
        f.seek(1 << 40)
        f.write(b"end" * 1365)
        f.seek(1 << 20)
        f.write(b"middle")
    W.copy_for_scorer(str(tree), str(view))
    got = (view / "big").stat()
    assert got.st_size == (tree / "big").stat().st_size
    assert got.st_blocks * 512 <= 1 << 20  # a few blocks, not a terabyte
    with open(view / "big", "rb") as f:
        f.seek(1 << 20)
        assert f.read(6) == b"middle"
        f.seek((1 << 40) - 1)
        assert f.read(4) == b"\0end"


def test_the_scorers_copy_stops_when_the_task_is_stopped(tmp_path: Path) -> None:
    tree, view = tmp_path / "tree", tmp_path / "view"
    (tree / "a").mkdir(parents=True)
    view.mkdir()
    calls: list[int] = []

    def stopped() -> bool:
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(InterruptedError, match="stopped while copying"):
        W.copy_for_scorer(str(tree), str(view), stopped)
