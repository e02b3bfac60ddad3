"""Snapshots with real git, against the workspace tricks of threat-model.md.

Each "does not run" test first shows that the same trick DOES run under plain git, so it cannot pass vacuously.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

from kernel.io import snapshot as S

PLAIN_GIT = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_SYSTEM": "/dev/null",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
}


def git(ws: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ws, env=PLAIN_GIT, check=True, capture_output=True, text=True
    ).stdout


def make_repo(tmp_path: Path, files: dict[str, str], *, commit: bool = True) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q", "-b", "main")
    for rel, text in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    if commit:
        git(ws, "add", "-A")
        git(ws, "commit", "-qm", "init")
    return ws


def snap(ws: Path, tmp_path: Path, seq: int = 1) -> S.Snapshot:
    kernel_tmp = tmp_path / "kernel-tmp"
    kernel_tmp.mkdir(exist_ok=True)
    return anyio.run(lambda: S.take_snapshot(ws, S.snapshot_ref("ws-abc", seq), tmp_dir=kernel_tmp))


def tree_of(ws: Path, rev: str) -> dict[str, str]:
    """path -> 'mode content' of every entry in `rev`."""
    out = {}
    for line in git(ws, "ls-tree", "-r", "--full-tree", rev).splitlines():
        meta, path = line.split("\t", 1)
        mode, _, oid = meta.split()
        out[path] = f"{mode} {git(ws, 'cat-file', 'blob', oid) if mode != '160000' else oid}"
    return out


def test_dirty_untracked_symlinks_and_modes_are_captured_and_the_channel_is_not(tmp_path: Path) -> None:
    ws = make_repo(
        tmp_path,
        {"train.py": "v1\n", "gone.txt": "x\n", ".gitignore": "*.log\nkept.log\n", "kept.log": "tracked\n"},
    )
    git(ws, "add", "-f", "kept.log")
    git(ws, "commit", "-qm", "track an ignored file")
    head = git(ws, "rev-parse", "HEAD").strip()
    (ws / "train.py").write_text("v2 dirty\n")
    (ws / "gone.txt").unlink()
    (ws / "new" / "deep").mkdir(parents=True)
    (ws / "new" / "deep" / "data.csv").write_text("1,2\n")
    (ws / "run.sh").write_text("#!/bin/sh\n")
    (ws / "run.sh").chmod(0o755)
    (ws / "noise.log").write_text("ignored\n")
    (ws / "latest").symlink_to("train.py")
    (ws / ".syscall" / "requests").mkdir(parents=True)
    (ws / ".syscall" / "kernel.json").write_text("{}")
    (ws / ".syscall" / "requests" / "r.json").write_text("{}")

    s = snap(ws, tmp_path)
    assert s.parent == head
    assert git(ws, "rev-parse", f"{s.ref}^").strip() == head
    assert git(ws, "rev-parse", f"{s.ref}^{{tree}}").strip() == s.tree
    assert git(ws, "rev-parse", s.ref).strip() == s.commit
    assert tree_of(ws, s.ref) == {
        ".gitignore": "100644 *.log\nkept.log\n",
        "kept.log": "100644 tracked\n",  # tracked stays tracked whatever .gitignore says
        "latest": "120000 train.py",
        "new/deep/data.csv": "100644 1,2\n",
        "run.sh": "100755 #!/bin/sh\n",
        "train.py": "100644 v2 dirty\n",
    }
    # The workspace's own index and HEAD are untouched.
    assert git(ws, "rev-parse", "HEAD").strip() == head
    assert "gone.txt" in git(ws, "ls-files")


def test_a_repository_without_commits_gets_a_root_commit(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"}, commit=False)
    s = snap(ws, tmp_path)
    assert s.parent is None
    assert git(ws, "rev-list", "--parents", "-n1", s.ref).split() == [s.commit]
    assert tree_of(ws, s.ref) == {"a.txt": "100644 a\n"}


def test_identical_content_gives_the_same_tree_and_a_new_seq_a_new_ref(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    s1, s2 = snap(ws, tmp_path, 1), snap(ws, tmp_path, 2)
    assert s1.tree == s2.tree
    assert s1.ref != s2.ref
    (ws / "a.txt").write_text("b\n")
    assert snap(ws, tmp_path, 3).tree != s1.tree


def test_release_drops_the_ref_and_is_idempotent(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    s = snap(ws, tmp_path)
    anyio.run(S.release, ws, s.ref)
    assert git(ws, "for-each-ref", "refs/syscall") == ""
    anyio.run(S.release, ws, s.ref)


def test_a_filter_driver_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "filter-ran"
    ws = make_repo(tmp_path, {"a.txt": "raw bytes\n", ".gitattributes": "* filter=evil\n"})
    evil = f"sh -c 'touch {marker}; tr a-z A-Z'"
    for key in ("clean", "smudge"):
        git(ws, "config", f"filter.evil.{key}", evil)
    git(ws, "config", "filter.evil.required", "true")
    (ws / "a.txt").write_text("dirty raw bytes\n")
    # Plain git does run it: the trick is live.
    git(ws, "add", "a.txt")
    assert marker.exists()
    git(ws, "reset", "-q")
    marker.unlink()

    s = snap(ws, tmp_path)
    assert not marker.exists(), "the workspace's filter driver ran during the snapshot"
    assert tree_of(ws, s.ref)["a.txt"] == "100644 dirty raw bytes\n"


def test_hooks_and_fsmonitor_do_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "hook-ran"
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    hooks = ws / ".git" / "hooks"
    for name in ("reference-transaction", "post-commit", "pre-commit", "post-checkout", "post-index-change"):
        (hooks / name).write_text(f"#!/bin/sh\necho {name} >> {marker}\n")
        (hooks / name).chmod(0o755)
    monitor = tmp_path / "fsmonitor.sh"
    monitor.write_text(f"#!/bin/sh\necho fsmonitor >> {marker}\n")
    monitor.chmod(0o755)
    git(ws, "config", "core.fsmonitor", str(monitor))
    # Plain git does run them.
    git(ws, "update-ref", "refs/heads/probe", "HEAD")
    git(ws, "status", "--porcelain")
    assert {"reference-transaction", "fsmonitor"} <= set(marker.read_text().split())
    marker.unlink()

    (ws / "b.txt").write_text("b\n")
    snap(ws, tmp_path)
    assert not marker.exists(), f"ran during the snapshot: {marker.read_text() if marker.exists() else ''}"


def test_gpg_signing_config_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "gpg-ran"
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    fake = tmp_path / "gpg.sh"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    fake.chmod(0o755)
    git(ws, "config", "commit.gpgSign", "true")
    git(ws, "config", "gpg.program", str(fake))
    snap(ws, tmp_path)
    assert not marker.exists()


def test_dot_git_as_a_file_is_refused(tmp_path: Path) -> None:
    real = make_repo(tmp_path, {"a.txt": "a\n"})
    ws = tmp_path / "linked"
    ws.mkdir()
    (ws / ".git").write_text(f"gitdir: {real / '.git'}\n")
    with pytest.raises(S.SnapshotError, match="not a directory"):
        snap(ws, tmp_path)


def test_dot_git_as_a_symlink_is_refused(tmp_path: Path) -> None:
    real = make_repo(tmp_path, {"a.txt": "a\n"})
    ws = tmp_path / "linked"
    ws.mkdir()
    (ws / ".git").symlink_to(real / ".git")
    with pytest.raises(S.SnapshotError, match="is a symlink"):
        snap(ws, tmp_path)


def test_a_workspace_without_git_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    with pytest.raises(S.SnapshotError, match="not a git repository"):
        snap(tmp_path / "ws", tmp_path)


def test_alternates_are_refused(tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    other = make_repo(tmp_path / "o", {"x": "x\n"})
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    (ws / ".git" / "objects" / "info" / "alternates").write_text(f"{other / '.git' / 'objects'}\n")
    with pytest.raises(S.SnapshotError, match="alternates"):
        snap(ws, tmp_path)


def test_config_includes_are_refused(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    (tmp_path / "elsewhere.cfg").write_text("[core]\n\tfsmonitor = true\n")
    git(ws, "config", "include.path", str(tmp_path / "elsewhere.cfg"))
    with pytest.raises(S.SnapshotError, match="include"):
        snap(ws, tmp_path)


def test_a_tracked_directory_swapped_for_a_symlink_is_not_followed(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"conf/settings.txt": "mine\n"})
    secret = tmp_path / "kernel-secrets"
    secret.mkdir()
    (secret / "settings.txt").write_text("TOP SECRET\n")
    (ws / "conf" / "settings.txt").unlink()
    (ws / "conf").rmdir()
    (ws / "conf").symlink_to(secret)
    s = snap(ws, tmp_path)
    entries = tree_of(ws, s.ref)
    assert entries == {"conf": f"120000 {secret}"}
    assert "TOP SECRET" not in "".join(entries.values())


def test_files_above_the_cap_are_refused_with_the_name(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    (ws / "big.bin").write_bytes(b"\0" * 2048)
    kernel_tmp = tmp_path / "kt"
    kernel_tmp.mkdir()
    with pytest.raises(S.SnapshotError, match=r"big\.bin.*per-file cap"):
        anyio.run(
            lambda: S.take_snapshot(ws, S.snapshot_ref("k", 1), tmp_dir=kernel_tmp, max_file_bytes=1024)
        )


def test_odd_file_names_survive(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    names = ["sp ace.txt", 'quo"te', "back\\slash", "new\nline", "tab\there", "ünï.txt"]
    for n in names:
        (ws / n).write_text(n)
    s = snap(ws, tmp_path)
    listed = git(ws, "ls-tree", "-r", "-z", "--name-only", s.ref).split("\0")
    assert set(names) <= set(listed)


def test_git_env_is_built_from_nothing_and_pins_the_dangerous_config() -> None:
    env = S.git_env("/w", filter_drivers=["lfs", "evil"])
    assert "HOME" not in env
    assert env["GIT_CONFIG_GLOBAL"] == env["GIT_CONFIG_SYSTEM"] == "/dev/null"
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    assert env["GIT_SSH_COMMAND"] == "false"
    cfg = {
        env[f"GIT_CONFIG_KEY_{i}"]: env[f"GIT_CONFIG_VALUE_{i}"] for i in range(int(env["GIT_CONFIG_COUNT"]))
    }
    assert cfg["core.hooksPath"] == "/dev/null"
    assert cfg["core.fsmonitor"] == "false"
    assert cfg["protocol.allow"] == "never"
    assert cfg["credential.helper"] == ""
    assert cfg["safe.directory"] == "/w"
    for d in ("lfs", "evil"):
        assert cfg[f"filter.{d}.clean"] == "cat"
        assert cfg[f"filter.{d}.process"] == ""
    assert not any(k.startswith("-c") for k in S.git_argv("status"))


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden"])
def test_snapshot_ref_refuses_unsafe_keys(bad: str) -> None:
    with pytest.raises(ValueError, match="workspace key"):
        S.snapshot_ref(bad, 1)


def test_includes_in_the_worktree_config_are_refused_too(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    git(ws, "config", "extensions.worktreeConfig", "true")
    git(ws, "config", "--worktree", "include.path", str(tmp_path / "elsewhere.cfg"))
    assert "include" in (ws / ".git" / "config.worktree").read_text()
    with pytest.raises(S.SnapshotError, match="include"):
        snap(ws, tmp_path)


def test_pure_helpers() -> None:
    assert S._cquote(b'a "b"\\c\nd\x7f') == b'"a \\"b\\"\\\\c\\012d\\177"'
    refusals, drivers = S.config_problems(
        ["core.bare", "filter.lfs.clean", "filter.a.b.process", "includeif.x.path"]
    )
    assert drivers == ["a.b", "lfs"]
    assert refusals == ["config key 'includeif.x.path' includes another file; includes are refused"]
    assert S.is_channel_path(b".syscall/requests/x.json")
    assert not S.is_channel_path(b".syscallx")
    assert not S.valid_repo_path(b".git/hooks/x")
    assert S.parse_ls_tree(b"100644 blob aa\tx y\x00160000 commit bb\tsub\x00") == [
        S._Entry(b"x y"),
        S._Entry(b"sub", "bb"),
    ]
