"""The sqlite store: durable settings, uniqueness per (workspace, id), schema versioning."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from channel.messages import Policy
from channel.safefs import Identity
from kernel.core.budget import Balance
from kernel.core.records import RequestRow, WorkspaceRow
from kernel.io.store import Store, StoreError, timestamp

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
