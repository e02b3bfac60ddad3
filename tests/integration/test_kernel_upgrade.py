"""Upgrading a real store made by an older commit of this repository, with a sleep in flight, and rolling back.

The older kernel is this repository at OLD_COMMIT, unpacked with `git archive` and run from its own tree
(`python -m kernel.cli` there imports its own packages; its dependencies are this venv's). Its store is at schema
1 without the `workspaces.subdirs` column, the store `status` and `check` failed on with `no such column:
subdirs` before the first new `serve`, and that rolling back to made crash on what the newer kernel wrote.
`jail = "none"`: the job waits on a file outside its tree (the jail has its own tests).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import subprocess
import tarfile
from pathlib import Path

import pytest
from kernelproc import ROOT, Kernel, git_workspace, put_request, read_answer, wait_for

from channel import release
from channel.paths import workspace_key
from kernel.io.store import SCHEMA_VERSION, backups

# The parent of 86036f0 (`git log -S subdirs -- kernel/io/store.py`), the commit that added workspaces.subdirs.
OLD_COMMIT = "4575f23899c5086510135cb793da1a520782da47"


def old_tree(dest: Path) -> Path:
    have = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{OLD_COMMIT}^{{commit}}"], capture_output=True
    )
    if have.returncode != 0:
        message = (
            f"commit {OLD_COMMIT} is not in this clone (a shallow clone? `git fetch --unshallow` brings it)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", OLD_COMMIT], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def schema_of(db: Path) -> tuple[int, set[str]]:
    """(user_version, the workspaces table's columns), read without writing."""
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        version = c.execute("PRAGMA user_version").fetchone()[0]
        return version, {r[1] for r in c.execute("PRAGMA table_info(workspaces)")}
    finally:
        c.close()


def charged(db: Path, key: str) -> tuple[int, int, int, int]:
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return c.execute(  # type: ignore[no-any-return]
            "SELECT launches, sleeps, gpu_s, reserved_gpu_s FROM workspaces WHERE key = ?", (key,)
        ).fetchone()
    finally:
        c.close()


@pytest.mark.slow
def test_a_store_of_an_older_commit_is_upgraded_with_a_sleep_in_flight_then_a_rollback_is_refused(
    tmp_path: Path,
) -> None:
    old = old_tree(tmp_path / "old")
    kernel = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\n', root=old)
    db = kernel.state / "state.sqlite"
    ws = git_workspace(tmp_path / "ws")
    key = workspace_key(str(ws.resolve()))
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"TMPDIR": str(tmp_path)}
    kernel.enroll(ws, "--launches", "5", "--sleeps", "5", "--gpu-hours", "2")
    command = f"echo $$ > {marks}/pid; while [ ! -e {marks}/go ]; do sleep 0.05; done; echo done > out.txt"
    request = {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "launches": [{"name": "long", "command": command, "minutes": 10, "artifacts": ["out.txt"]}],
    }
    try:
        kernel.start(env=env)
        put_request(ws, "s1", request)
        assert wait_for(lambda: read_answer(ws, "s1"), 30, "the answer")["type"] == "accepted"
        wait_for(lambda: (marks / "pid").exists() and (marks / "pid").read_text().strip(), 30, "the job")
        # the new release installed while the old kernel serves: a command that writes does not migrate under it
        kernel.root = ROOT
        held = kernel.cli("pause", str(ws), check=False)
        assert held.returncode != 0
        assert "a kernel serves it: restart that kernel with this release" in held.stderr, held.stderr
        kernel.root = old
        assert kernel.stop() == 0
        # what the older release left: its schema, the job running on, no wake yet
        version, columns = schema_of(db)
        assert (version, "subdirs" in columns) == (1, False), "OLD_COMMIT's store is not the older schema"
        assert not (ws / ".syscall" / "wakes" / "s1.json").exists()
        before = charged(db, key)
        assert before == (4, 4, 7200, 0)

        # the new release installed, not started yet: status and check read the old store, and write nothing
        kernel.root = ROOT
        image = db.read_bytes()
        for verb in ("status", "check"):
            done = kernel.cli(verb, check=False)
            said = done.stdout + done.stderr
            assert "Traceback" not in said, said
            assert "a migration is pending" in said, said
        assert kernel.cli("status").returncode == 0
        assert db.read_bytes() == image
        assert backups(db, 1) == []

        log_at = len(kernel.log_text())
        kernel.start(env=env, wait_ready=False)
        kernel.wait_log("event=ready", 60, count=2)  # one log for every start
        new_log = kernel.log_text()[log_at:]
        (backup,) = backups(db, 1)
        assert f"event=store_migrated store={db} backup={backup}" in new_log
        assert f"from=1 to={SCHEMA_VERSION}" in new_log
        assert schema_of(backup)[0] == 1
        version, columns = schema_of(db)
        assert (version, "subdirs" in columns) == (SCHEMA_VERSION, True)
        (marks / "go").touch()
        wake_file = ws / ".syscall" / "wakes" / "s1.json"
        wait_for(wake_file.exists, 30, "the wake from the upgraded kernel")
        kernel.wait_log("event=woken", 10)
        # the channel names the release that serves it now
        info = json.loads((ws / ".syscall" / "kernel.json").read_bytes())["kernel"]
        assert (info["version"], info.get("commit")) == (release.VERSION, release.COMMIT)
        assert kernel.stop() == 0
        after_log = kernel.log_text()[log_at:]
    finally:
        kernel.ensure_stopped()
        (marks / "go").touch()

    wake = json.loads(wake_file.read_bytes())
    [task] = wake["tasks"]
    assert (task["state"], task["exit_code"]) == ("COMPLETED", 0)
    [art] = task["artifacts"]
    assert (ws / ".syscall" / art["delivered"]).read_bytes() == b"done\n"
    assert after_log.count("event=woken") == 1
    assert sorted(os.listdir(ws / ".syscall" / "wakes")) == ["s1.json", "s1.md"]
    # charged once, by the older kernel: the reservation released, nothing taken again
    assert charged(db, key) == (4, 4, 7200, 0)
    budget = json.loads((ws / ".syscall" / "budget.json").read_bytes())["budget"]
    assert budget == {"launches": 4, "sleeps": 4, "gpu_hours": 2.0, "reserved_gpu_hours": 0.0}

    # rolled back: the older kernel refuses the newer store instead of crashing on it
    kernel.root = old
    log_at = len(kernel.log_text())
    proc = kernel.start(env=env, wait_ready=False)
    rc = proc.wait(60)
    kernel.ensure_stopped()
    refused = kernel.log_text()[log_at:]
    assert rc != 0
    # OLD_COMMIT's own words (a refusal logged as its crash line); not `Invalid enum value` on what it cannot read
    assert f"schema version {SCHEMA_VERSION}, this kernel needs 1" in refused, refused
    assert "Invalid enum value" not in refused, refused
    # and the documented way back: the backup copied over the store, which the older kernel serves
    for leftover in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        leftover.unlink(missing_ok=True)
    shutil.copyfile(backup, db)
    log_at = len(kernel.log_text())
    try:
        kernel.start(env=env, wait_ready=False)
        kernel.wait_log("event=ready", 60, count=3)
        # the sleep in flight at the upgrade is resumed from the backup's record: woken again, charged once
        kernel.wait_log("event=woken", 30, count=2)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    restored_log = kernel.log_text()[log_at:]
    assert restored_log.count("event=woken") == 1
    assert "wake_blocked" not in restored_log
    assert json.loads(wake_file.read_bytes())["tasks"][0]["state"] == "COMPLETED"
    assert charged(db, key) == (4, 4, 7200, 0)


def test_serve_refuses_a_store_of_a_newer_schema_naming_both_releases(tmp_path: Path) -> None:
    """The next rollback: this kernel over a store a newer release migrated. A refusal, not a crash."""
    kernel = Kernel(tmp_path, 'backend = "none"\n')
    kernel.enroll(git_workspace(tmp_path / "ws"))
    db = kernel.state / "state.sqlite"
    c = sqlite3.connect(db)
    c.execute("UPDATE store_meta SET value = 'syscall-kernel 9.0.0 (commit 1234abc)' WHERE name = 'release'")
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    c.commit()
    c.close()
    proc = kernel.start(wait_ready=False)
    try:
        assert proc.wait(60) == 2
    finally:
        kernel.ensure_stopped()
    said = kernel.log_text()
    assert "event=store_refused" in said
    assert (
        f"has schema version {SCHEMA_VERSION + 1} (written by syscall-kernel 9.0.0 (commit 1234abc))" in said
    )
    assert f"this kernel, syscall-kernel {release.VERSION}" in said
    assert "event=crashed" not in said
    for verb in ("status", "check"):
        done = kernel.cli(verb, check=False)
        assert done.returncode != 0
        assert f"reads schema versions up to {SCHEMA_VERSION}" in done.stdout + done.stderr
        assert "Traceback" not in done.stdout + done.stderr
