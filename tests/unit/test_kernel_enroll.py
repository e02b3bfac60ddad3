"""Enrollment on real directories with real git: what it creates, records and refuses."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
from _parts import TOOL

from channel import safefs
from channel.messages import BudgetFile, KernelInfo
from channel.paths import ChannelPaths
from kernel.core.config import Config, parse
from kernel.io.enroll import (
    QUIET_NS,
    EnrollError,
    Grant,
    OwnedElsewhere,
    enroll,
    owner_fingerprint,
    owner_unchanged,
)
from kernel.io.install import ToolSource
from kernel.io.store import AdminRow, Store


def dot_git(ws: Path) -> dict[str, bytes]:
    """Every entry of the workspace's `.git` with its bytes (links as their targets)."""
    out: dict[str, bytes] = {}
    for p in sorted((ws / ".git").rglob("*")):
        rel = str(p.relative_to(ws))
        if p.is_symlink():
            out[rel] = b"-> " + os.readlink(p).encode()
        elif p.is_file():
            out[rel] = p.read_bytes()
        else:
            out[rel] = b"<dir>"
    return out


def git_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return parse(f'state_dir = "{tmp_path}/state"\n[defaults]\nlaunches = 7\n', "<test>", env={})


def test_enroll_creates_and_records_the_channel(tmp_path: Path, cfg: Config, store: Store) -> None:
    ws = git_repo(tmp_path / "ws")
    before = dot_git(ws)
    done = enroll(store, cfg, str(ws), TOOL, Grant(gpu_hours=1.5))
    ch = ws / ".syscall"
    st = os.stat(ch)
    assert (done.row.identity.dev, done.row.identity.ino, done.row.identity.uid) == (
        st.st_dev,
        st.st_ino,
        st.st_uid,
    )
    assert {p.name for p in ch.iterdir()} >= {
        ".gitignore",
        "requests",
        "answers",
        "wakes",
        "results",
        "syscall",
        "kernel.json",
    }
    tool = ch / "syscall"
    assert tool.read_bytes() == TOOL.data
    assert stat.S_IMODE(tool.stat().st_mode) == 0o755
    info = msgspec.json.decode((ch / "kernel.json").read_bytes(), type=KernelInfo)
    assert info.tool_sha256 == TOOL.sha256
    assert info.workspace == str(ws)
    budget = msgspec.json.decode((ch / "budget.json").read_bytes(), type=BudgetFile).budget
    assert (budget.launches, budget.gpu_hours) == (7, 1.5)
    assert store.workspace(done.row.key).balance.gpu_s == 5400  # type: ignore[union-attr]
    assert dot_git(ws) == before  # enrollment writes nothing into the agent's .git (issue 10)
    status = subprocess.run(["git", "-C", str(ws), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == ""  # the channel is invisible to git
    assert "Installed version 9.9" in (ch / "tool-news.md").read_text()


def test_reenroll_is_idempotent_keeps_budget_and_repairs_the_tool(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    ws = git_repo(tmp_path / "ws")
    first = enroll(store, cfg, str(ws), TOOL, Grant(launches=3))
    (ws / ".syscall" / "syscall").write_bytes(b"tampered")
    (ws / ".syscall" / ".gitignore").write_bytes(b"!*\n")
    newer = ToolSource(TOOL.data + b'sub.add_parser("budget")\np.add_argument("--wait")\n')
    again = enroll(store, cfg, str(ws), newer)
    assert not again.created
    assert again.row.balance == first.row.balance
    assert (ws / ".syscall" / "syscall").read_bytes() == newer.data
    news = (ws / ".syscall" / "tool-news.md").read_text()
    assert "New verbs: `budget`" in news
    assert "`--wait`" in news
    assert (ws / ".syscall" / ".gitignore").read_bytes() == ChannelPaths.GITIGNORE_BYTES
    assert enroll(store, cfg, str(ws), newer).tool_note is None


def test_a_replaced_channel_is_adopted_only_by_an_explicit_enroll(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    ws = git_repo(tmp_path / "ws")
    first = enroll(store, cfg, str(ws), TOOL)
    (ws / ".syscall").rename(ws / "old-channel")
    with pytest.raises(EnrollError, match="not the directory enrolled before"):
        enroll(store, cfg, str(ws), TOOL, explicit=False)
    again = enroll(store, cfg, str(ws), TOOL, explicit=True)
    assert again.adopted_new_channel
    assert again.row.identity != first.row.identity


def test_refuses_a_workspace_that_tracks_the_channel(tmp_path: Path, cfg: Config, store: Store) -> None:
    ws = git_repo(tmp_path / "ws")
    (ws / ".syscall").mkdir()
    (ws / ".syscall" / "x").write_text("x")
    subprocess.run(["git", "-C", str(ws), "add", "-f", ".syscall/x"], check=True)
    with pytest.raises(
        EnrollError, match=r"tracks 1 file\(s\) under \.syscall/ \(\.syscall/x\).*git rm -r --cached"
    ):
        enroll(store, cfg, str(ws), TOOL)
    assert store.workspaces() == []


def test_git_config_programs_never_run(tmp_path: Path, cfg: Config, store: Store) -> None:
    ws = git_repo(tmp_path / "ws")
    marker = tmp_path / "pwned"
    hook = tmp_path / "fsmonitor.sh"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    subprocess.run(["git", "-C", str(ws), "config", "core.fsmonitor", str(hook)], check=True)
    enroll(store, cfg, str(ws), TOOL)
    assert not marker.exists()


@pytest.mark.parametrize(
    "case", ["missing", "file", "no-git", "git-symlink", "channel-symlink", "other-owner"]
)
def test_refuses_what_it_may_not_use(tmp_path: Path, cfg: Config, store: Store, case: str) -> None:
    ws = tmp_path / "ws"
    if case == "file":
        ws.write_text("x")
    elif case == "no-git":
        ws.mkdir()
    elif case == "git-symlink":
        git_repo(tmp_path / "real")
        ws.mkdir()
        (ws / ".git").symlink_to(tmp_path / "real" / ".git")
    elif case == "channel-symlink":
        git_repo(ws)
        (tmp_path / "elsewhere").mkdir()
        (ws / ".syscall").symlink_to(tmp_path / "elsewhere")
    elif case == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to chown")
        git_repo(ws)
        os.chown(ws, 4242, 4242)
    expected = {
        "missing": "no such directory",
        "file": "not a directory",
        "no-git": "not a git repository",
        "git-symlink": ".git is a symlink",
        "channel-symlink": "the channel cannot be made",
        "other-owner": "owned by uid 4242",
    }[case]
    with pytest.raises(EnrollError, match=expected):
        enroll(store, cfg, str(ws), TOOL)
    assert not (tmp_path / "elsewhere" / "requests").exists()


def test_links_planted_at_the_exclude_and_the_channel_gitignore_are_never_followed(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    ws = git_repo(tmp_path / "ws")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (ws / ".git/info/exclude").unlink()
    (ws / ".git/info/exclude").symlink_to(victim)
    with pytest.raises(EnrollError, match="exclude is a symlink"):
        enroll(store, cfg, str(ws), TOOL)
    assert victim.read_text() == "precious\n"
    (ws / ".git/info/exclude").unlink()
    enroll(store, cfg, str(ws), TOOL)
    ignore = ws / ".syscall" / ".gitignore"
    ignore.unlink()
    ignore.symlink_to(victim)
    before = dot_git(ws)
    enroll(store, cfg, str(ws), TOOL)
    assert victim.read_text() == "precious\n"
    assert not ignore.is_symlink()
    assert ignore.read_bytes() == ChannelPaths.GITIGNORE_BYTES
    assert dot_git(ws) == before


def test_a_workspace_account_is_kept_until_changed_and_a_bad_one_is_refused(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    ws = git_repo(tmp_path / "ws")
    done = enroll(store, cfg, str(ws), TOOL, slurm_account="proj-1")
    key = done.row.key
    assert (done.slurm_account, store.slurm_account(key)) == ("proj-1", "proj-1")
    assert enroll(store, cfg, str(ws), TOOL).slurm_account == "proj-1"  # a plain re-enroll keeps it
    with pytest.raises(EnrollError, match=r"--account 'a b' is not a Slurm account name"):
        enroll(store, cfg, str(ws), TOOL, slurm_account="a b")
    assert store.slurm_account(key) == "proj-1"  # a refused enroll changes nothing
    assert enroll(store, cfg, str(ws), TOOL, slurm_account="").slurm_account is None  # '' drops it
    assert store.slurm_account(key) is None


def test_automatic_enrollment_makes_the_channel_files_durable_before_its_rows_commit(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    """`prepare_new` (threads, no store) writes the channel files without an fsync each; the batch names its
    filesystems (`filesystems_of`: one here) for the sync that comes before `record_new` commits the rows: at the
    sync, every file is in place and no row exists."""
    from kernel.io.enroll import filesystems_of, new_facts, prepare_new, record_new
    from kernel.io.watch import read_mounts

    spaces = [git_repo(tmp_path / f"w{i}") for i in range(3)]
    facts = new_facts(store)
    batch = [prepare_new(facts, cfg, str(ws), TOOL, mounts=read_mounts()) for ws in spaces]
    assert all(store.workspace(p.row.key) is None for p in batch)  # nothing recorded by the preparation
    seen: list[str] = []

    def sync(path: str) -> None:
        for p in batch:
            assert store.workspace(p.row.key) is None, "a row committed before its files were synced"
            for name in (ChannelPaths.TOOL, ChannelPaths.KERNEL_JSON, ChannelPaths.BUDGET_JSON):
                assert (Path(p.row.path) / ".syscall" / name).is_file()
        seen.append(path)

    for path in filesystems_of(batch).values():
        sync(path)
    record_new(store, batch)
    assert len(seen) == 1  # one filesystem: one sync for the whole batch
    for p, ws in zip(batch, spaces, strict=True):
        row = store.workspace(p.row.key)
        assert row is not None
        assert row.path == str(ws.resolve())
        budget = msgspec.json.decode((ws / ".syscall" / "budget.json").read_bytes(), type=BudgetFile)
        assert budget.budget.launches == 7
        info = msgspec.json.decode((ws / ".syscall" / "kernel.json").read_bytes(), type=KernelInfo)
        assert info.owner is not None
        assert info.owner.store == store.store_id()


def test_automatic_enrollment_of_a_prepared_channel_again_is_idempotent(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    """A crash between the preparation and the commit leaves a channel without a row; preparing it again (the
    next start) gives the same channel, recorded once."""
    from kernel.io.enroll import new_facts, prepare_new, record_new
    from kernel.io.watch import read_mounts

    ws = git_repo(tmp_path / "w")
    facts = new_facts(store)
    first = prepare_new(facts, cfg, str(ws), TOOL, mounts=read_mounts())
    again = prepare_new(facts, cfg, str(ws), TOOL, mounts=read_mounts())
    assert again.row.identity == first.row.identity
    record_new(store, [again])
    assert [r.key for r in store.workspaces()] == [first.row.key]


def test_the_owner_fingerprint_accepts_only_the_very_file_unchanged(tmp_path: Path) -> None:
    """Issue 13 (restart ready in 2 s): a restart accepts the owner check from one lstat matching the
    fingerprint recorded when kernel.json was last read naming this store. Every change since (a rewrite in
    place keeping size and mtime, a rename onto the name, a chmod, a link) fails the match, and the full read
    then finds another store's owner; a file changed within QUIET_NS of the stat gets no fingerprint."""
    ws = tmp_path / "ws"
    ws.mkdir()
    mine, theirs = "a" * 32, "b" * 32

    def info(store: str) -> bytes:
        return msgspec.json.encode({"owner": {"store": store, "state_dir": "/s"}})

    with safefs.open_channel(ws, create=True) as ch:
        kj = ws / ".syscall" / ChannelPaths.KERNEL_JSON
        kj.write_bytes(info(mine))
        assert owner_fingerprint(ch, str(ws), mine=mine) is None, "changed just now: no fingerprint"
        time.sleep(QUIET_NS / 1e9 + 0.1)
        seen = owner_fingerprint(ch, str(ws), mine=mine)
        assert seen is not None
        assert owner_unchanged(ch, seen)
        assert owner_unchanged(ch, seen), "a read changes nothing"

        st = kj.stat()
        kj.write_bytes(info(theirs))  # in place, same size, mtime put back: only ctime tells
        os.utime(kj, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert kj.stat().st_size == st.st_size
        assert not owner_unchanged(ch, seen)
        with pytest.raises(OwnedElsewhere):
            owner_fingerprint(ch, str(ws), mine=mine)

        for change in ("rename", "chmod", "link"):
            kj.write_bytes(info(mine))
            time.sleep(QUIET_NS / 1e9 + 0.1)
            seen = owner_fingerprint(ch, str(ws), mine=mine)
            assert seen is not None
            assert owner_unchanged(ch, seen)
            if change == "rename":
                (ws / ".syscall" / "other").write_bytes(info(mine))
                os.replace(ws / ".syscall" / "other", kj)
            elif change == "chmod":
                kj.chmod(0o600)
            else:
                os.link(kj, tmp_path / "elsewhere")
            assert not owner_unchanged(ch, seen), change
            (tmp_path / "elsewhere").unlink(missing_ok=True)
        assert not owner_unchanged(ch, None)
        kj.unlink()
        assert not owner_unchanged(ch, seen)


def test_the_enrolled_keys_are_those_of_the_enrolled_rows(tmp_path: Path, cfg: Config, store: Store) -> None:
    """`enrolled_keys` (the rescan's look for channels not served) leaves out the unenrolled, as `workspaces`."""
    keys = [enroll(store, cfg, str(git_repo(tmp_path / f"ws{i}")), TOOL).row.key for i in range(3)]
    with store.transaction():
        store.set_admin(keys[1], AdminRow(unenrolled_at="2026-01-01T00:00:00Z"))
    assert store.enrolled_keys() == [r.key for r in store.workspaces()] == sorted([keys[0], keys[2]])
