"""The operator's side of submit through the real CLI: the eval contract at enrollment and `rebase`."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest
from kernelproc import Kernel, git

from channel.paths import workspace_key


def base_of(kernel: Kernel, ws: Path) -> tuple[str, str] | None:
    db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        row = db.execute(
            "SELECT base_commit, base_tree FROM eval_workspaces WHERE workspace=?",
            (workspace_key(ws.resolve()),),
        ).fetchone()
    finally:
        db.close()
    return None if row is None else (row[0], row[1])


def held(kernel: Kernel, ws: Path) -> set[str]:
    """The base trees the kernel's own repository of the workspace holds."""
    repo = kernel.state / "runs" / "repos" / f"{workspace_key(ws.resolve())}.git"
    done = subprocess.run(
        ["git", "--git-dir", str(repo), "for-each-ref", "--format=%(refname)", "refs/bases"],
        capture_output=True,
        text=True,
    )
    return {r.removeprefix("refs/bases/") for r in done.stdout.split()}


def agent_refs(ws: Path) -> str:
    return git(ws, "for-each-ref", "--format=%(refname)")


def policy(ws: Path) -> dict[str, object]:
    return json.loads((ws / ".syscall" / "kernel.json").read_text())["policy"]  # type: ignore[no-any-return]


def test_the_contract_and_the_base_are_the_operators(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    kernel = Kernel(tmp_path, "[defaults.submit]\ncommand = 'sh default.sh'\nmetric = 'acc'\n")

    bad = kernel.cli("enroll", str(ws), "--metric", "score", check=False)
    assert (bad.returncode, bad.stderr.strip()) == (
        2,
        "syscall-kernel enroll: --eval-command and --metric go together",
    )
    bad = kernel.cli("enroll", str(ws), "--min-delta", "0.1", check=False)
    assert "--min-delta need --eval-command and --metric" in bad.stderr
    bad = kernel.cli(
        "enroll", str(ws), "--eval-command", "x", "--metric", "s", "--min-delta", "-1", check=False
    )
    assert bad.returncode == 2
    assert "syscall-kernel enroll: --min-delta: expected `float` >= 0.0" in bad.stderr

    # No commit yet: the config's contract, and no base until there is one.
    kernel.enroll(ws)
    assert policy(ws)["submit"] == {
        "command": "sh default.sh",
        "metric": "acc",
        "direction": "higher",
        "min_delta": None,
        "min_relative": None,
        "eval_minutes": 30,
        "gpus": 0,
        "seed": True,
        "score": None,
        "score_data": None,
        "score_from": "operator",
        "protected": [],
        "repeats": 1,
        "confidence": 0.95,
        "test": "sign",
    }
    assert base_of(kernel, ws) is None
    (ws / "a").write_text("1\n")
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "one")
    first = git(ws, "rev-parse", "HEAD")
    kernel.enroll(ws, "--eval-command", "sh eval.sh", "--metric", "loss", "--direction", "lower", "--no-seed")
    assert base_of(kernel, ws) == (first, git(ws, "rev-parse", "HEAD^{tree}"))
    own = policy(ws)["submit"]
    assert (own["command"], own["metric"], own["direction"], own["seed"]) == (
        "sh eval.sh",
        "loss",
        "lower",
        False,
    )  # type: ignore[index]

    # Later commits and enrollments do not move the base or drop the workspace's own contract; a start neither.
    (ws / "a").write_text("2\n")
    git(ws, "commit", "-q", "-am", "two")
    kernel.enroll(ws)
    assert base_of(kernel, ws) == (first, git(ws, "rev-parse", f"{first}^{{tree}}"))
    kernel.start()
    try:
        assert policy(ws)["submit"] == own
    finally:
        assert kernel.stop() == 0

    moved = kernel.cli("rebase", str(ws))
    second = git(ws, "rev-parse", "HEAD")
    assert f"is now {second}" in moved.stdout
    assert base_of(kernel, ws) == (second, git(ws, "rev-parse", "HEAD^{tree}"))
    kernel.cli("rebase", str(ws), first[:10])
    assert base_of(kernel, ws) == (first, git(ws, "rev-parse", f"{first}^{{tree}}"))

    bad = kernel.cli("rebase", str(ws), "no-such-rev", check=False)
    assert bad.returncode == 1
    assert "'no-such-rev' is not a commit of" in bad.stderr
    bad = kernel.cli("rebase", str(tmp_path), check=False)
    assert (bad.returncode, "is not enrolled" in bad.stderr) == (1, True)
    assert base_of(kernel, ws) == (first, git(ws, "rev-parse", f"{first}^{{tree}}"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--eval-command", ""), "--eval-command: expected `str` of length >= 1"),
        (("--eval-command", "x" * 2001), "--eval-command: expected `str` of length <= 2000"),
        (("--metric", "top 1"), "--metric: expected `str` matching regex"),
        (("--metric", "value"), "--metric: 'value' is one of the reserved keys"),
        (("--eval-minutes", "0"), "--eval-minutes: expected `int` >= 1"),
        (("--eval-gpus", "65"), "--eval-gpus: expected `int` <= 64"),
        (("--min-relative", "nan"), "--min-relative: expected `float` >= 0.0"),
        (("--min-delta", "inf"), "--min-delta: expected `float` <="),
    ],
)
def test_eval_flags_are_checked_against_the_contract_bounds(
    tmp_path: Path, flags: tuple[str, str], message: str
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    kernel = Kernel(tmp_path)
    args = {"--eval-command": "sh eval.sh", "--metric": "score", flags[0]: flags[1]}
    bad = kernel.cli("enroll", str(ws), *(x for kv in args.items() for x in kv), check=False)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith(f"syscall-kernel enroll: {message}"), bad.stderr
    assert not (ws / ".syscall").exists()


def test_the_base_is_held_in_the_kernels_repository_and_moved_by_each_rebase(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "a").write_text("1\n")
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "one")
    first = git(ws, "rev-parse", "HEAD")
    first_tree = git(ws, "rev-parse", "HEAD^{tree}")
    kernel = Kernel(tmp_path)
    kernel.enroll(ws, "--eval-command", "sh eval.sh", "--metric", "score")
    assert base_of(kernel, ws) == (first, first_tree)
    assert held(kernel, ws) == {first_tree}
    assert "syscall" not in agent_refs(ws)  # nothing is written into the agent's repository

    # The agent rewrites its history and prunes the old commit: the kernel's copy of the base stays.
    (ws / "a").write_text("2\n")
    git(ws, "commit", "-q", "--amend", "-am", "rewritten")
    git(ws, "reflog", "expire", "--expire=now", "--all")
    git(ws, "gc", "-q", "--prune=now")
    assert subprocess.run(["git", "cat-file", "-e", first], cwd=ws).returncode != 0
    kernel.enroll(ws)
    assert base_of(kernel, ws) == (first, first_tree)
    assert held(kernel, ws) == {first_tree}

    # A rebase takes the named commit through the verified path and holds it (seeds are drawn per submit,
    # not per base: nothing to redraw).
    (ws / "a").write_text("3\n")
    git(ws, "commit", "-q", "-am", "three")
    for rev in ("HEAD", "HEAD~1", "HEAD"):
        kernel.cli("rebase", str(ws), rev)
        assert base_of(kernel, ws) == (git(ws, "rev-parse", rev), git(ws, "rev-parse", f"{rev}^{{tree}}"))
    assert held(kernel, ws) == {
        first_tree,
        git(ws, "rev-parse", "HEAD^{tree}"),
        git(ws, "rev-parse", "HEAD~1^{tree}"),
    }
    assert "syscall" not in agent_refs(ws)

    # A rebase to a commit that is gone leaves the base as it was.
    before = base_of(kernel, ws)
    bad = kernel.cli("rebase", str(ws), "0" * 40, check=False)
    assert bad.returncode == 1
    assert "is missing" in bad.stderr, bad.stderr
    assert base_of(kernel, ws) == before
