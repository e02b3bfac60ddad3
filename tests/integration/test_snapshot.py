"""Snapshots with real git, against the workspace tricks of docs/threat-model.md.

Each "does not run" test first shows that the same trick DOES run under plain git, so it cannot pass vacuously.
Snapshots go into the kernel's own repository (kernel.io.repo); the agent's `.git` is only ever read, by the
kernel itself, and checked byte for byte unchanged.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest
from kernelproc import PLAIN_GIT, plain_git

from kernel.io import repo as R
from kernel.io import snapshot as S


def make_repo(tmp_path: Path, files: dict[str, str], *, commit: bool = True) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    plain_git(ws, "init", "-q", "-b", "main")
    for rel, text in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    if commit:
        plain_git(ws, "add", "-A")
        plain_git(ws, "commit", "-qm", "init")
    return ws


def kernel_repo(tmp_path: Path) -> R.KernelRepo:
    return R.KernelRepo.at(tmp_path / "run", "ws-abc")


def snap(ws: Path, tmp_path: Path, seq: int = 1, **kw: int) -> S.Snapshot:
    kernel_tmp = tmp_path / "kernel-tmp"
    kernel_tmp.mkdir(exist_ok=True)
    return anyio.run(lambda: S.take_snapshot(ws, kernel_repo(tmp_path), seq, tmp_dir=kernel_tmp, **kw))


def kgit(tmp_path: Path, *args: str) -> str:
    """git in the kernel's repository."""
    env = {**PLAIN_GIT, "GIT_DIR": str(kernel_repo(tmp_path).path)}
    return subprocess.run(["git", *args], env=env, check=True, capture_output=True, text=True).stdout


def tree_of(tmp_path: Path, rev: str) -> dict[str, str]:
    """path -> 'mode content' of every entry in `rev` of the kernel's repository."""
    out = {}
    for line in kgit(tmp_path, "ls-tree", "-r", "--full-tree", rev).splitlines():
        meta, path = line.split("\t", 1)
        mode, _, oid = meta.split()
        out[path] = f"{mode} {kgit(tmp_path, 'cat-file', 'blob', oid) if mode != '160000' else oid}"
    return out


def fingerprint(root: Path) -> dict[str, tuple[int, int, float, bytes]]:
    """Every entry below `root` (links not followed): mode, size, mtime and content (or link target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            data = os.readlink(p).encode()
        elif p.is_file():
            data = p.read_bytes()
        else:
            data = b""
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime, data)
    return out


def test_dirty_untracked_symlinks_and_modes_are_captured_and_the_channel_is_not(tmp_path: Path) -> None:
    ws = make_repo(
        tmp_path,
        {"train.py": "v1\n", "gone.txt": "x\n", ".gitignore": "*.log\nkept.log\n", "kept.log": "tracked\n"},
    )
    plain_git(ws, "add", "-f", "kept.log")
    plain_git(ws, "commit", "-qm", "track an ignored file")
    head = plain_git(ws, "rev-parse", "HEAD")
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

    before = fingerprint(ws / ".git")
    s = snap(ws, tmp_path)
    assert s.parent == head
    assert s.ref == "refs/snapshots/1"
    assert kgit(tmp_path, "rev-list", "--parents", "-n1", s.ref).split() == [s.commit]  # a root commit
    assert head in kgit(tmp_path, "log", "-1", "--format=%B", s.ref)
    assert kgit(tmp_path, "rev-parse", f"{s.ref}^{{tree}}").strip() == s.tree
    assert kgit(tmp_path, "rev-parse", s.ref).strip() == s.commit
    assert tree_of(tmp_path, s.ref) == {
        ".gitignore": "100644 *.log\nkept.log\n",
        "kept.log": "100644 tracked\n",  # tracked stays tracked whatever .gitignore says
        "latest": "120000 train.py",
        "new/deep/data.csv": "100644 1,2\n",
        "run.sh": "100755 #!/bin/sh\n",
        "train.py": "100644 v2 dirty\n",
    }
    # The workspace's .git is untouched, byte for byte, and holds nothing of the snapshot.
    assert fingerprint(ws / ".git") == before
    assert subprocess.run(["git", "cat-file", "-e", s.commit], cwd=ws, env=PLAIN_GIT).returncode != 0
    assert "gone.txt" in plain_git(ws, "ls-files")


def test_a_repository_without_commits_gets_a_root_commit(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"}, commit=False)
    s = snap(ws, tmp_path)
    assert s.parent is None
    assert kgit(tmp_path, "rev-list", "--parents", "-n1", s.ref).split() == [s.commit]
    assert tree_of(tmp_path, s.ref) == {"a.txt": "100644 a\n"}


def test_identical_content_gives_the_same_tree_and_a_new_seq_a_new_ref(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    s1, s2 = snap(ws, tmp_path, 1), snap(ws, tmp_path, 2)
    assert s1.tree == s2.tree
    assert s1.ref != s2.ref
    (ws / "a.txt").write_text("b\n")
    assert snap(ws, tmp_path, 3).tree != s1.tree


def test_release_drops_the_ref_and_is_idempotent(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    snap(ws, tmp_path)
    anyio.run(S.release, kernel_repo(tmp_path), 1)
    assert kgit(tmp_path, "for-each-ref") == ""
    anyio.run(S.release, kernel_repo(tmp_path), 1)
    anyio.run(S.release, R.KernelRepo.at(tmp_path / "run", "never-made"), 1)


def test_a_filter_driver_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "filter-ran"
    ws = make_repo(tmp_path, {"a.txt": "raw bytes\n", ".gitattributes": "* filter=evil\n"})
    evil = f"sh -c 'touch {marker}; tr a-z A-Z'"
    for key in ("clean", "smudge"):
        plain_git(ws, "config", f"filter.evil.{key}", evil)
    plain_git(ws, "config", "filter.evil.required", "true")
    (ws / "a.txt").write_text("dirty raw bytes\n")
    # Plain git does run it: the trick is live.
    plain_git(ws, "add", "a.txt")
    assert marker.exists()
    plain_git(ws, "reset", "-q")
    marker.unlink()

    s = snap(ws, tmp_path)
    assert not marker.exists(), "the workspace's filter driver ran during the snapshot"
    assert tree_of(tmp_path, s.ref)["a.txt"] == "100644 dirty raw bytes\n"


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
    plain_git(ws, "config", "core.fsmonitor", str(monitor))
    # Plain git does run them.
    plain_git(ws, "update-ref", "refs/heads/probe", "HEAD")
    plain_git(ws, "status", "--porcelain")
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
    plain_git(ws, "config", "commit.gpgSign", "true")
    plain_git(ws, "config", "gpg.program", str(fake))
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


def test_alternates_are_never_read(tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    other = make_repo(tmp_path / "o", {"x": "x\n"})
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    (ws / ".git" / "objects" / "info" / "alternates").write_text(f"{other / '.git' / 'objects'}\n")
    s = snap(ws, tmp_path)
    assert tree_of(tmp_path, s.ref) == {"a.txt": "100644 a\n"}


def test_the_agents_config_is_never_read_includes_and_all(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    (tmp_path / "ignore-all").write_text("*.txt\n")
    (tmp_path / "elsewhere.cfg").write_text(f"[core]\n\texcludesFile = {tmp_path / 'ignore-all'}\n")
    plain_git(ws, "config", "include.path", str(tmp_path / "elsewhere.cfg"))
    (ws / "new.txt").write_text("new\n")
    # Plain git follows the include and hides new.txt.
    assert "new.txt" not in plain_git(ws, "ls-files", "--others", "--exclude-standard")
    s = snap(ws, tmp_path)
    assert "new.txt" in tree_of(tmp_path, s.ref)


def test_a_tracked_directory_swapped_for_a_symlink_is_not_followed(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"conf/settings.txt": "mine\n"})
    secret = tmp_path / "kernel-secrets"
    secret.mkdir()
    (secret / "settings.txt").write_text("TOP SECRET\n")
    (ws / "conf" / "settings.txt").unlink()
    (ws / "conf").rmdir()
    (ws / "conf").symlink_to(secret)
    s = snap(ws, tmp_path)
    entries = tree_of(tmp_path, s.ref)
    assert entries == {"conf": f"120000 {secret}"}
    assert "TOP SECRET" not in "".join(entries.values())


def test_files_above_the_cap_are_refused_with_the_name(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    (ws / "big.bin").write_bytes(b"\0" * 2048)
    kernel_tmp = tmp_path / "kt"
    kernel_tmp.mkdir()
    with pytest.raises(S.SnapshotError, match=r"big\.bin.*per-file cap"):
        snap(ws, tmp_path, max_file_bytes=1024)


def test_odd_file_names_survive(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    names = ["sp ace.txt", 'quo"te', "back\\slash", "new\nline", "tab\there", "ünï.txt"]
    for n in names:
        (ws / n).write_text(n)
    s = snap(ws, tmp_path)
    listed = kgit(tmp_path, "ls-tree", "-r", "-z", "--name-only", s.ref).split("\0")
    assert set(names) <= set(listed)


def test_git_env_is_built_from_nothing_and_pins_the_dangerous_config() -> None:
    env = R.neutral_env("/k/repo.git", work_tree="/w")
    assert "HOME" not in env
    assert env["GIT_DIR"] == "/k/repo.git"
    assert env["GIT_CONFIG_GLOBAL"] == env["GIT_CONFIG_SYSTEM"] == "/dev/null"
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    assert env["GIT_SSH_COMMAND"] == "false"
    assert env["GIT_OPTIONAL_LOCKS"] == "0"
    cfg = {
        env[f"GIT_CONFIG_KEY_{i}"]: env[f"GIT_CONFIG_VALUE_{i}"] for i in range(int(env["GIT_CONFIG_COUNT"]))
    }
    assert cfg["core.hooksPath"] == "/dev/null"
    assert cfg["core.fsmonitor"] == "false"
    assert cfg["core.logAllRefUpdates"] == "false"
    assert cfg["protocol.allow"] == "never"
    assert cfg["credential.helper"] == ""
    assert not any(k.startswith("-c") for k in R.git_argv("status"))


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "a..b"])
def test_kernel_repo_refuses_unsafe_keys(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workspace key"):
        R.KernelRepo.at(tmp_path, bad)


def test_pure_helpers() -> None:
    assert R._cquote(b'a "b"\\c\nd\x7f') == b'"a \\"b\\"\\\\c\\012d\\177"'
    assert S.is_channel_path(b".syscall/requests/x.json")
    assert not S.is_channel_path(b".syscallx")
    assert not S.valid_repo_path(b".git/hooks/x")
    assert not S.valid_repo_path(b"a/.GIT/x")
    assert S.parse_ls_files_stage(
        b"100644 aa 0\tx y\x00160000 bb 0\tsub\x00100644 cc 1\tc\x00100644 dd 2\tc\x00"
    ) == [S._Entry(b"x y"), S._Entry(b"sub", "bb"), S._Entry(b"c")]


def test_links_in_dot_git_are_never_followed_and_nothing_is_written_there(tmp_path: Path) -> None:
    """objects/, refs/, logs/ and packed-refs swapped for links to an outside directory, an index.lock planted,
    and `.git` read-only: the snapshot reads none of the links, writes nothing, and takes the working tree."""
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    head = plain_git(ws, "rev-parse", "HEAD")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("precious\n")
    dot = ws / ".git"
    for name in ("objects", "refs", "logs"):
        (dot / name).rename(tmp_path / f"real-{name}")
        (dot / name).symlink_to(outside)
    (dot / "packed-refs").symlink_to(outside / "victim")
    (dot / "index.lock").write_text("planted\n")
    (ws / "b.txt").write_text("b\n")
    before_out = fingerprint(outside)
    before = fingerprint(dot)
    for p in [dot, *dot.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)
    try:
        s = snap(ws, tmp_path)
    finally:
        for p in [dot, *dot.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)
    assert tree_of(tmp_path, s.ref) == {"a.txt": "100644 a\n", "b.txt": "100644 b\n"}
    assert s.parent is None  # HEAD names a branch under the linked refs/: not followed
    assert fingerprint(dot) == before
    assert fingerprint(outside) == before_out
    assert head  # (the branch the link hides)


def test_a_linked_index_is_refused_with_its_path(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n"})
    (ws / ".git" / "index").rename(tmp_path / "index")
    (ws / ".git" / "index").symlink_to(tmp_path / "index")
    with pytest.raises(S.SnapshotError, match=r"\.git/index is a symlink"):
        snap(ws, tmp_path)


def test_a_split_index_is_read_from_its_copy(tmp_path: Path) -> None:
    ws = make_repo(tmp_path, {"a.txt": "a\n", ".gitignore": "*.log\n", "kept.log": "x\n"})
    plain_git(ws, "add", "-f", "kept.log")
    plain_git(ws, "update-index", "--split-index")
    plain_git(ws, "commit", "-qm", "split")
    assert list((ws / ".git").glob("sharedindex.*"))
    s = snap(ws, tmp_path)
    assert set(tree_of(tmp_path, s.ref)) == {"a.txt", ".gitignore", "kept.log"}  # the ignored file is tracked


def test_the_walk_holds_a_bounded_number_of_fds(tmp_path: Path) -> None:
    """A tree of many directories is read with at most MAX_DIR_FDS directory fds open: under a file limit far
    below its directory count, every file is still in the snapshot (the walk used to hold one fd per
    directory until the import ended, and EMFILE made directories count as gone)."""
    import resource

    dirs = 600
    ws = make_repo(tmp_path, {f"d{i:03d}/x/f.txt": f"{i}\n" for i in range(dirs)}, commit=False)
    open_now = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + S.MAX_DIR_FDS + 100, hard))
    try:
        s = snap(ws, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert s.files == dirs
    tree = tree_of(tmp_path, s.commit)
    assert len([p for p in tree if p.endswith("/f.txt")]) == dirs


@pytest.mark.parametrize(
    ("files", "limits", "needle"),
    [
        ({f"f{i}.txt": "x" for i in range(12)}, {"max_files": 10}, "more than 10 files unignored"),
        ({"a/b/c/d/e/f.txt": "x"}, {"max_depth": 5}, "6 directories deep"),
        ({"big.bin": "x" * 5000}, {"max_total_bytes": 4096}, "4096 bytes"),
    ],
)
def test_a_workspace_past_a_limit_is_too_large_and_nothing_is_imported(
    tmp_path: Path, files: dict[str, str], limits: dict[str, int], needle: str
) -> None:
    ws = make_repo(tmp_path, files, commit=False)
    with pytest.raises(S.SnapshotTooLarge, match=needle) as got:
        snap(ws, tmp_path, **limits)
    assert ".gitignore" in str(got.value)
    (ws / ".gitignore").write_text("*\n")  # the fix the message names
    snap(ws, tmp_path, **limits)
