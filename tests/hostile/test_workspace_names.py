"""Workspace keys for any directory name (threat-model.md, "Workspace names").

A workspace's directory name is the agent's (or whoever made the directory a `workspaces` glob matches): its key
comes from one function, `channel.paths.workspace_key`, whose output every consumer accepts by construction (the
kernel's repository, run-directory names, Slurm job names). Before, `str.isalnum` kept non-ASCII letters and a
leading `_`; the repository refused those keys, and `serve` crashed at every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernelproc import Kernel, make_workspace, run_tool

from channel.paths import KEY_PATTERN, workspace_key
from kernel.backends.slurm.submit import job_name, parse_job_name
from kernel.io.repo import KernelRepo

HOSTILE_NAMES = ("expérience", "_scratch", "-dash", "with space", "new\nline", "日本語", "__", "a" * 80)

# Any name a directory can have: any characters but `/` and NUL, undecodable bytes included (surrogateescape).
names = st.one_of(
    st.text(
        st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1, max_size=300
    ),
    st.binary(min_size=1, max_size=300).filter(lambda b: b"/" not in b and b"\0" not in b).map(os.fsdecode),
)


@given(name=names)
def test_every_directory_name_gives_a_key_every_consumer_accepts(name: str) -> None:
    key = workspace_key(f"/srv/agents/{name}")
    assert KEY_PATTERN.fullmatch(key), key
    assert KernelRepo.at("/run", key).path.name == f"{key}.git"
    assert parse_job_name(job_name(key, 7, "train")) == (key, 7, "train")


def test_a_name_that_was_already_safe_keeps_its_key() -> None:
    path = "/srv/agents/proj_2-x"
    assert workspace_key(path) == f"proj_2-x-{hashlib.sha256(path.encode()).hexdigest()[:10]}"


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_name_gives_a_valid_key(name: str) -> None:
    key = workspace_key(f"/srv/{name}")
    assert KEY_PATTERN.fullmatch(key), key


@pytest.mark.bwrap
def test_workspaces_with_any_name_are_served_by_glob_and_by_enroll(
    tmp_path: Path, bwrap_available: None
) -> None:
    """A `workspaces` glob matching hostile names and an operator's `enroll` of one: `enroll` exits 0 without a
    traceback, `serve` starts and answers every workspace's sleep, and each job runs in the default (bwrap) jail
    on that workspace's snapshot."""
    root = tmp_path / "agents"
    spaces = [make_workspace(root / name) for name in HOSTILE_NAMES]
    manual = make_workspace(tmp_path / "manual" / "_élève")
    kernel = Kernel(tmp_path, f'workspaces = ["{root}/*"]\n')
    done = kernel.cli("enroll", str(manual))
    assert "Traceback" not in done.stderr + done.stdout
    kernel.start()
    try:
        for ws in [*spaces, manual]:
            # In the jail the job sees its snapshot, not the host's workspace (its channel is not there).
            seen = f"cat README; test -e {shlex.quote(str(ws / '.syscall'))} && echo unjailed || echo jailed"
            launched = run_tool(ws, "launch", "--name", "hello", "--", seen, timeout=60)
            assert launched.returncode == 0, launched.stdout + launched.stderr + kernel.log_text()[-2000:]
            woke = run_tool(ws, "sleep", "--wait", "--json", "--timeout", "60", timeout=90)
            assert woke.returncode == 0, woke.stdout + woke.stderr + kernel.log_text()[-2000:]
            wake = json.loads(woke.stdout)
            [task] = wake["tasks"]
            # The job ran jailed on this workspace's own snapshot: its README names the directory.
            assert (task["state"], task["stdout_tail"]) == ("COMPLETED", f"workspace {ws.name}\njailed\n"), (
                task
            )
    finally:
        kernel.stop()
    assert "event=crashed" not in kernel.log_text()


@pytest.mark.bwrap
def test_a_store_with_a_key_an_older_kernel_made_is_rekeyed_and_served(
    tmp_path: Path, bwrap_available: None
) -> None:
    """An older kernel's `enroll` recorded `_scratch-<hash>` before crashing: the store is re-keyed when opened
    and the workspace served (before: `serve` crashed at every start)."""
    ws = make_workspace(tmp_path / "_scratch")
    kernel = Kernel(tmp_path)
    kernel.enroll(ws)
    new = workspace_key(ws.resolve())
    legacy = "_" + new
    db = sqlite3.connect(kernel.state / "state.sqlite")
    with db:
        db.execute("PRAGMA defer_foreign_keys = ON")
        tables = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        db.execute("UPDATE workspaces SET key = ? WHERE key = ?", (legacy, new))
        for t in tables:
            if "workspace" in {r[1] for r in db.execute(f"PRAGMA table_info({t})")}:
                db.execute(f"UPDATE {t} SET workspace = ? WHERE workspace = ?", (legacy, new))
    db.close()
    kernel.start()
    try:
        launched = run_tool(ws, "launch", "--name", "hello", "--", "cat README", timeout=60)
        assert launched.returncode == 0, launched.stdout + launched.stderr
        woke = run_tool(ws, "sleep", "--wait", "--json", "--timeout", "60", timeout=90)
        assert woke.returncode == 0, woke.stdout + woke.stderr + kernel.log_text()[-2000:]
        [task] = json.loads(woke.stdout)["tasks"]
        assert (task["state"], task["stdout_tail"]) == ("COMPLETED", "workspace _scratch\n"), task
    finally:
        kernel.stop()
    log = kernel.log_text()
    assert "event=crashed" not in log
    assert f"event=workspace_rekeyed old={legacy} new={new}" in log
