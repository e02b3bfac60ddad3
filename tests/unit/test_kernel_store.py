"""The sqlite store: durable settings, uniqueness per (workspace, id), schema versioning."""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from channel import release
from channel.messages import EvalContract, Policy, SidePath
from channel.safefs import Identity
from kernel.core.budget import Balance
from kernel.core.records import RequestRow, WorkspaceRow
from kernel.io.store import SCHEMA_VERSION, Store, StoreError, StoreNewer, backups, timestamp

NOW = timestamp(1796040000.0)


def row(key: str = "w-1") -> WorkspaceRow:
    return WorkspaceRow(
        key, f"/ws/{key}", Identity(1, 2, 3), Balance(1, 2, 3600), Policy(), "s", "inotify", NOW, None
    )


def test_wal_and_full_sync(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "db.sqlite")
    assert s._one("PRAGMA journal_mode")[0] == "wal"
    assert s._one("PRAGMA synchronous")[0] == 2  # FULL
    s.close()


def test_timestamp_format() -> None:
    assert NOW == "2026-11-30T12:00:00.000Z"


def test_round_trip_and_uniqueness(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "db.sqlite")
    with s.transaction():
        s.put_workspace(row())
    got = s.workspace("w-1")
    assert got == row()
    req = RequestRow("w-1", "a", "h", "status", NOW, None, None, b"{}", NOW)
    with s.transaction():
        s.insert_request(req)
    with pytest.raises(sqlite3.IntegrityError), s.transaction():
        s.insert_request(req)
    assert s.request("w-1", "a") == req
    assert s.count_requests() == 1
    s.close()


def test_a_failed_transaction_leaves_nothing(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "db.sqlite")

    def fail() -> None:
        with s.transaction():
            s.put_workspace(row())
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        fail()
    assert s.workspaces() == []
    s.close()


def test_budgets_cannot_go_negative_even_by_sql(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "db.sqlite")
    with s.transaction():
        s.put_workspace(row())
    with pytest.raises(sqlite3.IntegrityError), s.transaction():
        s._conn.execute("UPDATE workspaces SET gpu_s = -1")
    s.close()


def test_readonly_open_and_version_checks(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no state store"):
        Store.open(tmp_path / "none.sqlite", readonly=True)
    s = Store.open(tmp_path / "db.sqlite")
    s._conn.execute("PRAGMA user_version = 99")
    s.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store.open(tmp_path / "db.sqlite")


# The side tables as the executor and kernel.io.submit made them before they moved into the store's migrations
# (eval_plans as first released, without `seeds` and `protected_changed`).
_OLD_SIDE_DDL = (
    "CREATE TABLE IF NOT EXISTS exec_sleeps (workspace TEXT NOT NULL, seq INTEGER NOT NULL, ref TEXT NOT NULL, "
    "commit_id TEXT NOT NULL, tree TEXT NOT NULL, wake_json BLOB, wake_md BLOB, released INTEGER NOT NULL DEFAULT 0, "
    "PRIMARY KEY (workspace, seq)) STRICT",
    "CREATE TABLE IF NOT EXISTS eval_workspaces (workspace TEXT PRIMARY KEY, base_commit TEXT, base_tree TEXT, "
    "base_set_at TEXT, seed INTEGER, contract BLOB) STRICT",
    "CREATE TABLE IF NOT EXISTS eval_plans (workspace TEXT NOT NULL, seq INTEGER NOT NULL, decision TEXT NOT NULL, "
    "contract BLOB NOT NULL, seed INTEGER, base_commit TEXT, base_tree TEXT, candidate_commit TEXT NOT NULL, "
    "candidate_tree TEXT NOT NULL, baseline_key TEXT, reused_value TEXT, PRIMARY KEY (workspace, seq)) STRICT",
    "CREATE TABLE IF NOT EXISTS eval_verdicts (workspace TEXT NOT NULL, seq INTEGER NOT NULL, sleep_id TEXT NOT NULL, "
    "outcome TEXT NOT NULL, verdict BLOB NOT NULL, report TEXT NOT NULL, created_at TEXT NOT NULL, "
    "hook_status TEXT NOT NULL, PRIMARY KEY (workspace, seq)) STRICT",
    "CREATE TABLE IF NOT EXISTS eval_measurements (key TEXT PRIMARY KEY, seeds TEXT NOT NULL, vals TEXT NOT NULL, "
    "workspace TEXT NOT NULL, seq INTEGER NOT NULL, measured_at TEXT NOT NULL) STRICT",
)


def test_a_database_made_by_the_old_side_table_ddl_opens_and_keeps_its_data(tmp_path: Path) -> None:
    from kernel.io import submit as S

    path = tmp_path / "db.sqlite"
    Store.open(path).close()
    db = sqlite3.connect(path)
    for t in ("exec_sleeps", "eval_workspaces", "eval_plans", "eval_verdicts", "eval_measurements"):
        db.execute(f"DROP TABLE {t}")
    for stmt in _OLD_SIDE_DDL:
        db.execute(stmt)
    db.execute(
        "INSERT INTO exec_sleeps (workspace, seq, ref, commit_id, tree) VALUES ('w-1', 1, 'r', 'c1', 't1')"
    )
    db.execute("INSERT INTO eval_workspaces (workspace, base_commit, base_tree) VALUES ('w-1', 'bc', 'bt')")
    db.execute(
        "INSERT INTO eval_plans (workspace, seq, decision, contract, candidate_commit, candidate_tree) "
        "VALUES ('w-1', 1, 'no_base', ?, 'cc', 'ct')",
        (msgspec.json.encode(EvalContract(command="python eval.py", metric="score")),),
    )
    db.execute("INSERT INTO eval_measurements VALUES ('k', '[7]', '[\"0.5\"]', 'w-1', 1, 'now')")
    db.commit()
    db.close()

    for _ in range(2):  # the migration is idempotent: a second open changes nothing
        s = Store.open(path)
        got = s.exec_sleep("w-1", 1)
        assert got is not None
        assert (got.ref, got.commit, got.tree, got.released) == ("r", "c1", "t1", False)
        assert S.base_of(s, "w-1") == ("bc", "bt")
        plan = S.plan_of(s, "w-1", 1)
        assert plan is not None
        assert (plan.decision, plan.seeds, plan.protected_changed) == ("no_base", (), ())
        assert plan.removed == S.Removed()
        assert S.measurement(s, "k") is not None
        s.close()

    s = Store.open(path)
    with s.transaction():  # the added columns are written
        removed = S.Removed(
            (SidePath(side="candidate", path="__pycache__/m.pyc", why="a bytecode cache"),), 3
        )
        S.put_plan(s, replace(plan, seq=2, seeds=(1, 2), protected_changed=("eval.py",), removed=removed))
    again = S.plan_of(s, "w-1", 2)
    assert again is not None
    assert (again.seeds, again.protected_changed, again.removed) == ((1, 2), ("eval.py",), removed)
    s.close()


def test_a_sleep_advances_only_through_the_lifecycle_table_and_only_from_the_state_named(
    tmp_path: Path,
) -> None:
    from channel.lifecycle import IllegalTransition, SleepEvent
    from kernel.core.records import SleepRow

    s = Store.open(tmp_path / "db.sqlite")
    with s.transaction():
        s.put_workspace(row())
        s.insert_sleep(SleepRow("w-1", 1, "s1", "validated", "", None, NOW, None, None))
        # compare-and-set: the sleep is not `snapshotted`, so nothing moves
        assert not s.advance_sleep("w-1", 1, "snapshotted", SleepEvent.SUBMIT)
        assert s.advance_sleep("w-1", 1, "validated", SleepEvent.SNAPSHOT)
        # a second writer that read `validated` earlier loses: the sleep is not moved twice
        assert not s.advance_sleep("w-1", 1, "validated", SleepEvent.REJECT)
    got = s.sleep("w-1", 1)
    assert got is not None
    assert got.state == "snapshotted"
    # a move the table does not have raises, even from the sleep's actual state
    with pytest.raises(IllegalTransition, match="'snapshotted' cannot wake"), s.transaction():
        s.advance_sleep("w-1", 1, "snapshotted", SleepEvent.WAKE)
    with s.transaction():
        assert s.advance_sleep("w-1", 1, "snapshotted", SleepEvent.SUBMIT)
        assert s.advance_sleep("w-1", 1, "submitted", SleepEvent.GATHER)
        assert s.advance_sleep("w-1", 1, "gathered", SleepEvent.WAKE, woken_at=NOW)
    got = s.sleep("w-1", 1)
    assert got is not None
    assert (got.state, got.woken_at) == ("woken", NOW)


def test_a_task_advances_only_through_the_lifecycle_table_and_only_from_the_state_named(
    tmp_path: Path,
) -> None:
    from channel.lifecycle import IllegalTransition, TaskEvent
    from kernel.core.records import JobRow, SleepRow

    later = timestamp(1796040001.0)
    s = Store.open(tmp_path / "db.sqlite")
    with s.transaction():
        s.put_workspace(row())
        s.insert_sleep(SleepRow("w-1", 1, "s1", "validated", "", None, NOW, None, None))
        s.insert_jobs(
            [
                JobRow("w-1", 1, "a", t, 2, 0, "x", 10, 1, (), "", 600, "PENDING", updated_at=NOW)
                for t in range(2)
            ]
        )

    def job(t: int) -> JobRow:
        return next(j for j in s.jobs_of("w-1", 1) if j.task == t)

    with s.transaction():
        # compare-and-set: the task is not RUNNING, so nothing moves
        assert not s.advance_task("w-1", 1, "a", 0, "RUNNING", TaskEvent.FINISH, "COMPLETED", at=later)
        assert s.advance_task("w-1", 1, "a", 0, "PENDING", TaskEvent.START, at=later, started_at=later)
        # a second writer that read PENDING earlier loses: a cancel does not overwrite the start
        assert not s.advance_task("w-1", 1, "a", 0, "PENDING", TaskEvent.CANCEL, at=later, release=True)
    assert (job(0).state, job(0).started_at, job(0).updated_at, job(0).reserved_gpu_s) == (
        "RUNNING",
        later,
        later,
        600,
    )
    # a move the table does not have raises, even from the task's actual state; nothing is written
    with pytest.raises(IllegalTransition, match="'RUNNING' cannot skip"), s.transaction():
        s.advance_task("w-1", 1, "a", 0, "RUNNING", TaskEvent.SKIP, "SKIPPED", at=later)
    with pytest.raises(IllegalTransition, match="into 'CANCELLED'"), s.transaction():
        s.advance_task("w-1", 1, "a", 0, "RUNNING", TaskEvent.FINISH, "CANCELLED", at=later)
    with pytest.raises(IllegalTransition), s.transaction():
        s.advance_task("w-1", 1, "a", 1, "COMPLETED", TaskEvent.FINISH, "FAILED", at=later)
    assert job(0).state == "RUNNING"
    with s.transaction():
        assert s.advance_task(
            "w-1", 1, "a", 0, "RUNNING", TaskEvent.FINISH, "FAILED", at=later, exit_code=3, ended_at=later
        )
        # a cancel that raced the end loses, and a terminal task never moves again
        assert not s.advance_task("w-1", 1, "a", 0, "RUNNING", TaskEvent.CANCEL, at=later)
        # the other task: cancelled before dispatch, its reservation released with it
        assert s.advance_task(
            "w-1", 1, "a", 1, "PENDING", TaskEvent.CANCEL, at=later, ended_at=later, release=True
        )
        # placement is compare-and-set on the job id; the gather's release zeroes a reservation once
        assert s.place_job("w-1", 1, "a", 0, backend="local", job_id="7", run_dir="/r/7", at=later)
        assert not s.place_job("w-1", 1, "a", 0, backend="local", job_id="8", run_dir="/r/8", at=later)
        assert s.release_job("w-1", 1, "a", 0)
        assert not s.release_job("w-1", 1, "a", 1)
    j0, j1 = job(0), job(1)
    assert (j0.state, j0.exit_code, j0.ended_at, j0.job_id, j0.reserved_gpu_s) == ("FAILED", 3, later, "7", 0)
    assert (j1.state, j1.ended_at, j1.reserved_gpu_s) == ("CANCELLED", later, 0)
    # a task is born PENDING; any other state is reached only through advance_task
    with pytest.raises(IllegalTransition, match="recorded as 'RUNNING'"), s.transaction():
        s.insert_jobs([replace(j0, task=5, state="RUNNING")])
    assert len(s.jobs_of("w-1", 1)) == 2


def test_only_the_compare_and_set_methods_write_a_state() -> None:
    """Every SQL statement of the store that sets a sleep's or a task's `state` is in advance_sleep /
    advance_task and is conditional on the state read (`AND state=?`), so no writer moves a state past the
    lifecycle table (the old `update_job` wrote whatever state its caller computed)."""
    import ast
    import inspect
    import re

    from kernel.io import store as store_module

    writers: dict[str, list[str]] = {}
    for fn in ast.walk(ast.parse(inspect.getsource(store_module))):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                # adjacent literals are one constant in the AST: a statement split over lines is seen whole
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    sql = " ".join(node.value.split())
                    m = re.match(r"UPDATE \w+ SET (.*?) WHERE (.*)", sql)
                    if m and re.search(r"\bstate\s*=", m.group(1)):
                        writers.setdefault(fn.name, []).append(m.group(2))
    assert set(writers) == {"advance_sleep", "advance_task"}, writers
    assert all(w.endswith("AND state=?") for ws in writers.values() for w in ws), writers


def test_subdirectory_identities_round_trip_and_an_older_store_gains_the_column(tmp_path: Path) -> None:
    """Spec 2.3: each channel subdirectory's (device, inode) is recorded; a store made before the column
    existed is migrated additively (its rows read with none recorded, everything else kept)."""
    path = tmp_path / "state.db"
    s = Store.open(path)
    with s.transaction():
        s.put_workspace(row("w-old"))
    subdirs = (("requests", 1, 10), ("answers", 1, 11), ("wakes", 1, 12), ("results", 1, 13))
    recorded = replace(row("w-new"), identity=Identity(1, 2, 3, subdirs))
    with s.transaction():
        s.put_workspace(recorded)
    got = s.workspace("w-new")
    assert got is not None
    assert got.identity.subdirs == subdirs
    # An older store: the column dropped, as a store of the previous release lacks it.
    with s.transaction():
        s._conn.execute("ALTER TABLE workspaces DROP COLUMN subdirs")
    s.close()
    s = Store.open(path)
    old = s.workspace("w-old")
    assert old is not None
    assert old.identity.subdirs == ()
    assert old.balance == row("w-old").balance
    s.close()


def test_a_transaction_without_the_fsync_commits_and_sync_wal_makes_it_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`transaction(durable=False)` commits (another connection sees it) with synchronous=NORMAL for that one
    transaction only, FULL again afterwards, even when it fails; `sync_wal` fsyncs the WAL file itself."""
    s = Store.open(tmp_path / "s.sqlite")
    try:
        full = s._conn.execute("PRAGMA synchronous").fetchone()[0]
        assert full == 2
        with s.transaction(durable=False):
            assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 1
            s._conn.execute("INSERT INTO store_meta (name, value) VALUES ('probe', 'x')")
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        other = sqlite3.connect(tmp_path / "s.sqlite")
        assert other.execute("SELECT value FROM store_meta WHERE name = 'probe'").fetchone() == ("x",)
        other.close()
        with pytest.raises(RuntimeError), s.transaction(durable=False):
            raise RuntimeError("boom")
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2

        synced: list[int] = []
        real = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd))[1])
        s.sync_wal()
        s.sync_wal()
        assert synced == [os.stat(f"{tmp_path / 's.sqlite'}-wal").st_ino] * 2
    finally:
        s.close()


def store_with_w1(path: Path) -> Path:
    s = Store.open(path)
    with s.transaction():
        s.put_workspace(row("w-1"))
    s.close()
    return path


def _without_sleep_wake_on(db: sqlite3.Connection) -> None:
    """The sleeps table as schema 6 and older had it: no `wake_on`, `rest` or `woke_by`."""
    for column in ("wake_on", "rest", "woke_by"):
        db.execute(f"ALTER TABLE sleeps DROP COLUMN {column}")


def _without_job_sweeps(db: sqlite3.Connection) -> None:
    """The jobs table as schema 3 and older had it: no `params`, `rank` or `metrics` (nor schema 5's table)."""
    _without_contract_told(db)
    for column in ("params", "rank", "metrics"):
        db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")


def _without_job_resources(db: sqlite3.Connection) -> None:
    """The jobs table as schema 2 and older had it: no `mem_mb`, no `cpus` (nor schema 4's columns)."""
    _without_job_sweeps(db)
    db.execute("ALTER TABLE jobs DROP COLUMN mem_mb")
    db.execute("ALTER TABLE jobs DROP COLUMN cpus")


def _store_at(tmp_path: Path, version: int, older: Callable[[sqlite3.Connection], None]) -> Path:
    """A store with one task of sleep 1 (launch `old`), made what a release at `version` left (`older`)."""
    from kernel.core.records import JobRow, SleepRow

    path = store_with_w1(tmp_path / "state.sqlite")
    s = Store.open(path)
    with s.transaction():
        s.insert_sleep(SleepRow("w-1", 1, "s1", "validated", "", None, NOW, None, None))
        s.insert_jobs([JobRow("w-1", 1, "old", 0, 1, 0, "x", 10, 0, (), "", 0, "PENDING", updated_at=NOW)])
    s.close()
    db = sqlite3.connect(path)
    older(db)
    db.execute(f"PRAGMA user_version = {version}")
    db.commit()
    db.close()
    return path


def test_a_schema_2_store_gets_the_job_resource_columns_and_its_tasks_read_as_asking_for_none(
    tmp_path: Path,
) -> None:
    """Schema 3 added `jobs.mem_mb` and `jobs.cpus`: a store at 2 (its tasks recorded without them) is migrated,
    its tasks read as the site's default (None), and a new task's request is kept."""
    from kernel.core.records import JobRow, SleepRow

    path = _store_at(tmp_path, 2, _without_job_resources)
    s = Store.open(path)
    assert s._one("PRAGMA user_version")[0] == SCHEMA_VERSION
    (old,) = s.jobs_of("w-1", 1)
    assert (old.mem_mb, old.cpus) == (None, None)
    new = JobRow(
        "w-1", 2, "big", 0, 1, 0, "x", 10, 0, (), "", 0, "PENDING", updated_at=NOW, mem_mb=8192, cpus=4
    )
    with s.transaction():
        s.insert_sleep(SleepRow("w-1", 2, "s2", "validated", "", None, NOW, None, None))
        s.insert_jobs([new])
    assert [(j.mem_mb, j.cpus) for j in s.jobs_of("w-1", 2)] == [(8192, 4)]
    s.close()
    (backup,) = backups(path, 2)
    assert backup.name.startswith(f"state.sqlite.v2-before-v{SCHEMA_VERSION}.")


def test_a_schema_3_store_gets_the_sweep_columns_and_its_tasks_read_as_unswept(tmp_path: Path) -> None:
    """Schema 4 added `jobs.params`, `jobs.rank` and `jobs.metrics`: a store at 3 is migrated, its tasks read as
    without a sweep, a rank or recorded numbers, and a new task's values, rank and numbers are kept."""
    from kernel.core.records import JobRow, SleepRow

    path = _store_at(tmp_path, 3, _without_job_sweeps)
    s = Store.open(path)
    assert s._one("PRAGMA user_version")[0] == SCHEMA_VERSION
    (old,) = s.jobs_of("w-1", 1)
    assert (old.params, old.rank, old.metrics) == ((), None, {})
    new = JobRow(
        "w-1",
        2,
        "grid",
        1,
        2,
        0,
        "x",
        10,
        0,
        (),
        "",
        0,
        "PENDING",
        updated_at=NOW,
        params=(("lr", "3e-3"), ("wd", "0")),
        rank="-acc",
    )
    with s.transaction():
        s.insert_sleep(SleepRow("w-1", 2, "s2", "validated", "", None, NOW, None, None))
        s.insert_jobs([new])
        s.set_job_metrics("w-1", 2, "grid", 1, {"acc": 0.9, "n": 3})
    (got,) = s.jobs_of("w-1", 2)
    assert (got.params, got.rank, got.metrics) == (
        (("lr", "3e-3"), ("wd", "0")),
        "-acc",
        {"acc": 0.9, "n": 3.0},
    )
    s.close()
    (backup,) = backups(path, 3)
    assert backup.name.startswith(f"state.sqlite.v3-before-v{SCHEMA_VERSION}.")


def _without_job_width(db: sqlite3.Connection) -> None:
    """The jobs table as schema 5 and older had it: no `width` (nor schema 7's columns)."""
    _without_sleep_wake_on(db)
    db.execute("ALTER TABLE jobs DROP COLUMN width")


def _without_contract_told(db: sqlite3.Connection) -> None:
    """The store as schema 4 and older had it: no `contract_told` (nor schema 6's column)."""
    _without_job_width(db)
    db.execute("DROP TABLE contract_told")


def test_a_schema_4_store_gets_the_contract_told_table_with_nothing_told(tmp_path: Path) -> None:
    """Schema 5 added `contract_told`: a store at 4 is migrated, no workspace told anything yet (its next answer
    tells nothing and records the contract), and a contract told is kept."""
    path = _store_at(tmp_path, 4, _without_contract_told)
    s = Store.open(path)
    assert s._one("PRAGMA user_version")[0] == SCHEMA_VERSION
    assert s.contract_told("w-1") is None
    with s.transaction():
        s.set_contract_told("w-1", b'{"a":1}')
    with s.transaction():
        s.set_contract_told("w-1", b'{"a":2}')
    assert s.contract_told("w-1") == b'{"a":2}'
    s.close()
    (backup,) = backups(path, 4)
    assert backup.name.startswith(f"state.sqlite.v4-before-v{SCHEMA_VERSION}.")


def test_a_schema_5_store_gets_the_width_column_and_its_tasks_read_as_decided_at_dispatch(
    tmp_path: Path,
) -> None:
    """Schema 6 added `jobs.width` (tasks of a launch at once, decided at acceptance): a store at 5 is migrated,
    its tasks read as recorded without one (None: dispatch decides as before), and a new task's width is kept."""
    from kernel.core.records import JobRow, SleepRow

    path = _store_at(tmp_path, 5, _without_job_width)
    s = Store.open(path)
    assert s._one("PRAGMA user_version")[0] == SCHEMA_VERSION
    (old,) = s.jobs_of("w-1", 1)
    assert old.width is None
    new = JobRow("w-1", 2, "gpu", 0, 8, 0, "x", 10, 4, (), "", 0, "PENDING", updated_at=NOW, width=2)
    with s.transaction():
        s.insert_sleep(SleepRow("w-1", 2, "s2", "validated", "", None, NOW, None, None))
        s.insert_jobs([new])
    assert [j.width for j in s.jobs_of("w-1", 2)] == [2]
    s.close()
    (backup,) = backups(path, 5)
    assert backup.name.startswith(f"state.sqlite.v5-before-v{SCHEMA_VERSION}.")


def test_a_schema_6_store_gets_the_wake_on_columns_and_its_sleeps_read_as_waking_when_all_end(
    tmp_path: Path,
) -> None:
    """Schema 7 added `sleeps.wake_on`, `sleeps.rest` and `sleeps.woke_by`: a store at 6 is migrated, its sleeps
    read as waking when every task has ended (`all`, `run`, no trigger), and a new sleep's condition and the
    trigger recorded for it are kept (the trigger once)."""
    from kernel.core.records import SleepRow

    path = _store_at(tmp_path, 6, _without_sleep_wake_on)
    s = Store.open(path)
    assert s._one("PRAGMA user_version")[0] == SCHEMA_VERSION == 7
    old = s.sleep("w-1", 1)
    assert old is not None
    assert (old.wake_on, old.rest, old.trigger, old.rest_tasks) == ("all", "run", None, ())
    with s.transaction():
        s.insert_sleep(
            SleepRow("w-1", 2, "s2", "validated", "", None, NOW, None, None, wake_on=3, rest="cancel")
        )
        s.insert_sleep(SleepRow("w-1", 3, "s3", "validated", "", None, NOW, None, None, wake_on="first-exit"))
        assert s.set_sleep_trigger("w-1", 2, ("grid", 4), [("grid", 0), ("other", 1)])
        assert not s.set_sleep_trigger("w-1", 2, ("grid", 0), [])
    two, three = s.sleep("w-1", 2), s.sleep("w-1", 3)
    assert two is not None
    assert three is not None
    assert (two.wake_on, two.rest, two.trigger, two.rest_tasks) == (
        3,
        "cancel",
        ("grid", 4),
        (("grid", 0), ("other", 1)),
    )
    assert (three.wake_on, three.rest, three.trigger) == ("first-exit", "run", None)
    s.close()
    (backup,) = backups(path, 6)
    assert backup.name.startswith("state.sqlite.v6-before-v7.")


def _as_schema_1(path: Path) -> None:
    """Make the store at `path` what a release at schema 1 left: user_version 1, without the columns and tables
    releases at 1 added later (`workspaces.subdirs`, `store_meta`)."""
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE workspaces DROP COLUMN subdirs")
    db.execute("DROP TABLE store_meta")
    _without_job_resources(db)
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()


def test_an_older_store_is_backed_up_then_migrated_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The migration logged nothing, took no backup and left user_version at 1."""
    path = store_with_w1(tmp_path / "state.sqlite")
    _as_schema_1(path)
    caplog.set_level(logging.INFO)
    s = Store.open(path)
    assert s._one("PRAGMA user_version")[0] == SCHEMA_VERSION
    assert s.workspace("w-1") is not None
    assert s.store_id() is not None
    s.close()
    (backup,) = backups(path, 1)
    assert backup.name.startswith(f"state.sqlite.v1-before-v{SCHEMA_VERSION}.")
    (line,) = [r.getMessage() for r in caplog.records if "event=store_migrated" in r.getMessage()]
    for part in (f"backup={backup}", f"store={path}", "from=1", f"to={SCHEMA_VERSION}"):
        assert part in line.split(" "), (part, line)
    # the backup is the store as it was: schema 1, its rows, not the migrated columns
    old = sqlite3.connect(f"file:{backup}?mode=ro", uri=True)
    assert old.execute("PRAGMA user_version").fetchone()[0] == 1
    assert old.execute("SELECT key FROM workspaces").fetchall() == [("w-1",)]
    assert "subdirs" not in {r[1] for r in old.execute("PRAGMA table_info(workspaces)")}
    old.close()
    # the next open has nothing to migrate
    caplog.clear()
    Store.open(path).close()
    assert "store_migrated" not in caplog.text
    assert backups(path, 1) == [backup]


def test_a_newer_store_is_refused_naming_both_versions_and_the_way_back(tmp_path: Path) -> None:
    """Rolling back made the old kernel crash on what the newer one wrote (`Invalid enum value 'tail'`)."""
    path = store_with_w1(tmp_path / "state.sqlite")
    (
        tmp_path / f"state.sqlite.v{SCHEMA_VERSION}-before-v{SCHEMA_VERSION + 1}.20270101T000000Z.bak"
    ).write_bytes(path.read_bytes())
    db = sqlite3.connect(path)
    db.execute("UPDATE store_meta SET value = 'syscall-kernel 9.1.0 (commit 0123abc)' WHERE name = 'release'")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    before = path.read_bytes()
    for readonly in (False, True):
        with pytest.raises(StoreNewer) as err:
            Store.open(path, readonly=readonly)
        msg = str(err.value)
        assert (
            f"has schema version {SCHEMA_VERSION + 1} (written by syscall-kernel 9.1.0 (commit 0123abc))"
            in msg
        )
        assert f"syscall-kernel {release.VERSION}" in msg
        assert f"reads schema versions up to {SCHEMA_VERSION}" in msg
        assert "Install the newer release again" in msg
        assert (
            str(
                tmp_path / f"state.sqlite.v{SCHEMA_VERSION}-before-v{SCHEMA_VERSION + 1}.20270101T000000Z.bak"
            )
            in msg
        )
    assert path.read_bytes() == before


def test_a_read_only_open_of_an_older_store_reads_a_migrated_copy_and_writes_nothing(tmp_path: Path) -> None:
    """`status` and `check` before the first new `serve` printed `no such column: subdirs`."""
    path = store_with_w1(tmp_path / "state.sqlite")
    _as_schema_1(path)
    before = path.read_bytes()
    s = Store.open(path, readonly=True)
    assert s.pending_migration == (1, SCHEMA_VERSION)
    (ws,) = s.workspaces()
    assert (ws.key, ws.identity.subdirs, ws.balance) == ("w-1", (), row("w-1").balance)
    assert s.store_id() is None  # drawn by the migrating open, not made up by a reader
    s.close()
    # (sqlite's -wal and -shm files come and go with any reader of a WAL store)
    assert path.read_bytes() == before
    assert backups(path, 1) == []
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 1
    fresh = Store.open(tmp_path / "other.sqlite")
    fresh.close()
    assert Store.open(tmp_path / "other.sqlite", readonly=True).pending_migration is None


def test_what_the_stores_queries_count_as_live_is_the_lifecycles_sets(tmp_path: Path) -> None:
    """The store's SQL takes its lists of states from channel.lifecycle (never spelled by hand): for every state
    of the protocol, a sleep or task in it is live, or ended, exactly as the lifecycle's sets say."""
    import contextlib
    import sqlite3
    from typing import get_args

    from channel.lifecycle import LIVE_TASK_STATES, SLEEP_TERMINAL
    from channel.messages import SleepState, TaskState
    from kernel.core.records import JobRow, SleepRow

    sleep_states, task_states = get_args(SleepState), get_args(TaskState)
    db = tmp_path / "db.sqlite"
    s = Store.open(db)
    with s.transaction():
        for i in range(len(sleep_states)):
            s.put_workspace(row(f"w-{i}"))
            s.insert_sleep(SleepRow(f"w-{i}", 1, f"s{i}", "validated", "", None, NOW, None, None))
            s.record_snapshot(f"w-{i}", 1, f"refs/snapshots/{i}", "c" * 40, "t" * 40)
        n = len(task_states)
        s.insert_jobs(
            [
                JobRow("w-0", 1, "a", t, n, 0, "x", 10, 1, (), "", 600, "PENDING", updated_at=NOW)
                for t in range(n)
            ]
        )
    # Every state set directly, past the lifecycle's moves: what is asked here is only how each is counted.
    with contextlib.closing(sqlite3.connect(db)) as raw, raw:
        raw.executemany(
            "UPDATE sleeps SET state=? WHERE workspace=?",
            [(st, f"w-{i}") for i, st in enumerate(sleep_states)],
        )
        raw.executemany("UPDATE jobs SET state=? WHERE task=?", [(st, t) for t, st in enumerate(task_states)])
    live = {st for st in sleep_states if st not in SLEEP_TERMINAL}
    of = dict(enumerate(sleep_states))
    assert {x.state for x in s.live_sleeps()} == live
    assert {of[i] for i in range(len(of)) if s.current_sleep(f"w-{i}") is not None} == live
    assert {of[int(key[2:])] for key, _ in s.unreleased_snapshots()} == set(SLEEP_TERMINAL)
    assert {j.state for j in s.live_jobs()} == LIVE_TASK_STATES
    counts = s.counts()
    assert (counts["live_sleeps"], counts["live_jobs"]) == (len(live), len(LIVE_TASK_STATES))
    s.close()
