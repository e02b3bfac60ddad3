"""`kernel.io.submit`'s hold on the base commit, against real git: what an agent may do to the kernel's ref."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kernel.io import submit as S


def git(ws: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=ws,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str, str]:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q", "-b", "main")
    git(ws, "commit", "-q", "--allow-empty", "-m", "one")
    first = git(ws, "rev-parse", "HEAD")
    git(ws, "commit", "-q", "--allow-empty", "-m", "two")
    return ws, first, git(ws, "rev-parse", "HEAD")


def test_the_base_ref_is_created_moved_and_kept_through_gc(repo: tuple[Path, str, str]) -> None:
    ws, first, second = repo
    assert S.base_ref("w-1") == "refs/syscall/w-1/base"
    assert S.held_base(str(ws), "w-1") is None
    S.hold_base(str(ws), "w-1", first)
    assert S.held_base(str(ws), "w-1") == first
    S.hold_base(str(ws), "w-1", second)
    S.hold_base(str(ws), "w-1", second)  # idempotent
    assert S.held_base(str(ws), "w-1") == second
    git(ws, "reset", "-q", "--hard", first)  # the agent drops `two` from its history
    git(ws, "reflog", "expire", "--expire=now", "--all")
    git(ws, "gc", "-q", "--prune=now")
    assert git(ws, "cat-file", "-t", second) == "commit"


def test_a_ref_the_agent_made_symbolic_is_replaced_and_its_branch_never_moved(
    repo: tuple[Path, str, str],
) -> None:
    ws, first, second = repo
    git(ws, "symbolic-ref", "refs/syscall/w-1/base", "refs/heads/main")
    S.hold_base(str(ws), "w-1", first)
    assert S.held_base(str(ws), "w-1") == first
    assert git(ws, "rev-parse", "refs/heads/main") == second
    gone = subprocess.run(["git", "symbolic-ref", "-q", "refs/syscall/w-1/base"], cwd=ws, check=False)
    assert gone.returncode == 1  # a plain ref now


def test_what_cannot_be_held_is_refused_with_the_ref_named(repo: tuple[Path, str, str]) -> None:
    ws, first, _ = repo
    S.hold_base(str(ws), "w-1", first)
    for bad in ("0" * 40, "HEAD", first[:12], "-d"):
        with pytest.raises(S.BaseError, match="is not a commit id"):
            S.hold_base(str(ws), "w-1", bad)
    with pytest.raises(S.BaseError, match=r"cannot hold the base 1{12} under refs/syscall/w-1/base"):
        S.hold_base(str(ws), "w-1", "1" * 40)  # no such object
    assert S.held_base(str(ws), "w-1") == first
    git(ws, "update-ref", "refs/syscall/w-2/base/x", first)  # the agent made the ref's name a directory
    with pytest.raises(S.BaseError, match="refs/syscall/w-2/base"):
        S.hold_base(str(ws), "w-2", first)
    for bad in ("", "a/b", "..", ".x"):
        with pytest.raises(ValueError, match="not a single safe ref component"):
            S.base_ref(bad)
