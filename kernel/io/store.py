"""The kernel's durable state: one sqlite database in `state_dir`.

WAL with `synchronous=FULL`: a committed transaction survives a power cut, and `syscall-kernel status` can read
while the service writes. The rule the pipeline follows is that every state change is committed here BEFORE its
side effect (an answer file, a budget.json, a job submission), so a kernel killed at any instant resumes from the
store without losing or repeating anything. Tables: workspaces (identity, budget, policy), requests (unique per
workspace and id, with the content hash and the exact answer bytes), sleeps, and jobs (one row per task, with the
columns execution needs). Budgets are exact integers (GPU-seconds).

One `Store` is used by one thread at a time (the pipeline's worker); sqlite's own locking serialises processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread
import msgspec

from channel import release
from channel.lifecycle import (
    FIRST_TASK_STATE,
    LIVE_TASK_STATES,
    SLEEP_OVER_FOR_AGENT,
    SLEEP_TERMINAL,
    IllegalTransition,
    SleepEvent,
    TaskEvent,
    next_sleep_state,
    next_task_state,
)
from channel.messages import Policy, SleepState, TaskState
from channel.paths import key_is_safe, workspace_key
from channel.safefs import Identity
from kernel.core.budget import Balance
from kernel.core.records import ExecSleepRow, JobRow, RequestRow, SleepRow, WorkspaceRow
from kernel.io import log, stepguard
from kernel.io.budgetorder import BudgetOrder

# The schema this kernel writes, in `PRAGMA user_version`. Releases at 1 made the tables and columns of
# _ADMIN_SCHEMA and _ADDED_COLUMNS when missing without changing it, so a store at 1 holds any subset of them;
# 2 is a store with all of them; 3 adds the memory and CPUs a launch asked for per task (jobs.mem_mb, jobs.cpus); 4
# a swept task's values, its launch's rank key and the numbers of its last JSON line (jobs.params, jobs.rank,
# jobs.metrics); 5 the contract each workspace was last told (contract_told); 6 how many tasks of a launch run at
# once, decided at acceptance (jobs.width); 7 a sleep's wake condition, what its early wake does with the rest and
# the task that met it (sleeps.wake_on, sleeps.rest, sleeps.woke_by). A change to the schema raises it and adds a
# step to _MIGRATIONS.
SCHEMA_VERSION: Final = 7


def _sql_states(states: frozenset[str]) -> str:
    """A set of lifecycle states as an SQL list of literals, sorted: the same text at every start, so the
    `jobs_live` index's condition and the queries it serves stay the same expression."""
    if not all(s.replace("_", "").isalpha() for s in states):
        raise ValueError(f"not a state name: {sorted(states)}")
    return "(" + ", ".join(f"'{s}'" for s in sorted(states)) + ")"


# The lifecycle's sets (channel.lifecycle) as the store's SQL spells them: never written out by hand.
_LIVE_TASKS: Final = _sql_states(LIVE_TASK_STATES)
_SLEEP_ENDED: Final = _sql_states(SLEEP_TERMINAL)
_SLEEP_OVER: Final = _sql_states(SLEEP_OVER_FOR_AGENT)
_WOKEN: Final[SleepState] = "woken"

# Schema 5: the contract (kernel.core.contract.encoded) the kernel last told each workspace, recorded in the
# transaction that records the answer or wake that told it; no row: none told yet.
_CONTRACT_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS contract_told (
    workspace       TEXT PRIMARY KEY REFERENCES workspaces(key),
    contract        BLOB NOT NULL
) STRICT;
"""

_SCHEMA: Final = (
    f"""
CREATE TABLE workspaces (
    key             TEXT PRIMARY KEY,
    path            TEXT NOT NULL UNIQUE,
    dev             INTEGER NOT NULL,
    ino             INTEGER NOT NULL,
    uid             INTEGER NOT NULL,
    launches        INTEGER NOT NULL CHECK (launches >= 0),
    sleeps          INTEGER NOT NULL CHECK (sleeps >= 0),
    gpu_s           INTEGER NOT NULL CHECK (gpu_s >= 0),
    reserved_gpu_s  INTEGER NOT NULL DEFAULT 0 CHECK (reserved_gpu_s >= 0),
    policy          BLOB NOT NULL,
    tool_sha256     TEXT NOT NULL,
    watch           TEXT NOT NULL,
    enrolled_at     TEXT NOT NULL,
    problem         TEXT,
    subdirs         TEXT
) STRICT;

CREATE TABLE requests (
    workspace       TEXT NOT NULL REFERENCES workspaces(key),
    id              TEXT NOT NULL,
    sha256          TEXT NOT NULL,
    type            TEXT NOT NULL,
    received_at     TEXT NOT NULL,
    sleep_seq       INTEGER,
    body            BLOB,
    answer          BLOB,
    answered_at     TEXT,
    PRIMARY KEY (workspace, id)
) STRICT;
CREATE INDEX requests_open ON requests(workspace) WHERE answer IS NULL;

CREATE TABLE sleeps (
    workspace       TEXT NOT NULL REFERENCES workspaces(key),
    seq             INTEGER NOT NULL,
    id              TEXT NOT NULL,
    state           TEXT NOT NULL,
    note            TEXT NOT NULL,
    submit          BLOB,
    created_at      TEXT NOT NULL,
    woken_at        TEXT,
    verdict         BLOB,
    wake_on         TEXT,
    rest            TEXT,
    woke_by         TEXT,
    PRIMARY KEY (workspace, seq),
    UNIQUE (workspace, id)
) STRICT;

CREATE TABLE jobs (
    workspace       TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    launch          TEXT NOT NULL,
    task            INTEGER NOT NULL,
    array_size      INTEGER NOT NULL,
    concurrency     INTEGER NOT NULL,
    command         TEXT NOT NULL,
    minutes         INTEGER NOT NULL,
    gpus            INTEGER NOT NULL,
    artifacts       BLOB NOT NULL,
    why             TEXT NOT NULL,
    reserved_gpu_s  INTEGER NOT NULL,
    state           TEXT NOT NULL,
    backend         TEXT,
    job_id          TEXT,
    exit_code       INTEGER,
    signal          INTEGER,
    started_at      TEXT,
    ended_at        TEXT,
    run_dir         TEXT,
    updated_at      TEXT NOT NULL,
    mem_mb          INTEGER,
    cpus            INTEGER,
    params          TEXT,
    rank            TEXT,
    metrics         TEXT,
    width           INTEGER,
    PRIMARY KEY (workspace, seq, launch, task),
    FOREIGN KEY (workspace, seq) REFERENCES sleeps(workspace, seq)
) STRICT;
CREATE INDEX jobs_live ON jobs(state) WHERE state IN {_LIVE_TASKS};
"""
    + _CONTRACT_SCHEMA
)

# Added while SCHEMA_VERSION was 1, so made if missing (additive only): by the migration to 2, and again at every
# read-write open. A table added from now on comes with a SCHEMA_VERSION of its own. Every table the kernel keeps
# is made here, the executor's (exec_sleeps) and submit's (eval_*) included: no other module
# creates or alters one.
_ADMIN_SCHEMA: Final = """
-- The stat of each channel's kernel.json when it was last read and found to name this store (or none), taken
-- before that read and only when its ctime was over a second old (kernel.io.enroll.owner_fingerprint): a
-- restart accepts the owner check from one lstat that matches it.
CREATE TABLE IF NOT EXISTS owner_seen (
    workspace       TEXT PRIMARY KEY,
    dev             INTEGER NOT NULL,
    ino             INTEGER NOT NULL,
    size            INTEGER NOT NULL,
    mtime_ns        INTEGER NOT NULL,
    ctime_ns        INTEGER NOT NULL
) STRICT;

CREATE TABLE IF NOT EXISTS store_meta (
    name            TEXT PRIMARY KEY,
    value           TEXT NOT NULL
) STRICT;

CREATE TABLE IF NOT EXISTS workspace_admin (
    workspace       TEXT PRIMARY KEY REFERENCES workspaces(key),
    paused_at       TEXT,
    unenrolled_at   TEXT,
    overrides       BLOB
) STRICT;

CREATE TABLE IF NOT EXISTS workspace_slurm (
    workspace       TEXT PRIMARY KEY REFERENCES workspaces(key),
    account         TEXT NOT NULL
) STRICT;

CREATE TABLE IF NOT EXISTS pruned_sleeps (
    workspace       TEXT NOT NULL REFERENCES workspaces(key),
    seq             INTEGER NOT NULL,
    pruned_at       TEXT NOT NULL,
    run_bytes       INTEGER NOT NULL,
    result_bytes    INTEGER NOT NULL,
    PRIMARY KEY (workspace, seq)
) STRICT;

CREATE TABLE IF NOT EXISTS seq_floors (
    workspace       TEXT PRIMARY KEY REFERENCES workspaces(key),
    floor           INTEGER NOT NULL
) STRICT;

CREATE TABLE IF NOT EXISTS budget_changes (
    workspace       TEXT NOT NULL REFERENCES workspaces(key),
    at              TEXT NOT NULL,
    who             TEXT NOT NULL,
    change          TEXT NOT NULL,
    before          BLOB NOT NULL,
    after           BLOB NOT NULL
) STRICT;

CREATE TABLE IF NOT EXISTS exec_sleeps (
    workspace   TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    ref         TEXT NOT NULL,
    commit_id   TEXT NOT NULL,
    tree        TEXT NOT NULL,
    wake_json   BLOB,
    wake_md     BLOB,
    released    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (workspace, seq)
) STRICT;

CREATE TABLE IF NOT EXISTS eval_workspaces (
    workspace   TEXT PRIMARY KEY,
    base_commit TEXT,
    base_tree   TEXT,
    base_set_at TEXT,
    seed        INTEGER,
    contract    BLOB
) STRICT;

CREATE TABLE IF NOT EXISTS eval_plans (
    workspace       TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    decision        TEXT NOT NULL,
    contract        BLOB NOT NULL,
    seed            INTEGER,
    base_commit     TEXT,
    base_tree       TEXT,
    candidate_commit TEXT NOT NULL,
    candidate_tree  TEXT NOT NULL,
    baseline_key    TEXT,
    reused_value    TEXT,
    PRIMARY KEY (workspace, seq)
) STRICT;

CREATE TABLE IF NOT EXISTS eval_verdicts (
    workspace   TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    sleep_id    TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    verdict     BLOB NOT NULL,
    report      TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    hook_status TEXT NOT NULL,
    PRIMARY KEY (workspace, seq)
) STRICT;

CREATE TABLE IF NOT EXISTS eval_measurements (
    key         TEXT PRIMARY KEY,
    seeds       TEXT NOT NULL,
    vals        TEXT NOT NULL,
    workspace   TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    measured_at TEXT NOT NULL
) STRICT;

CREATE TABLE IF NOT EXISTS eval_disclosure (
    workspace       TEXT PRIMARY KEY,
    best            TEXT NOT NULL,
    spent           INTEGER NOT NULL,
    noisy_threshold REAL
) STRICT;
"""
# Columns added to a table while SCHEMA_VERSION was 1: added to an older database at open (as _ADMIN_SCHEMA).
_ADDED_COLUMNS: Final = (
    ("eval_plans", "seeds", "TEXT"),
    ("eval_plans", "protected_changed", "TEXT"),
    ("eval_plans", "shadows_removed", "TEXT"),
    # the seq of the submit whose base measurement (and seeds) a `reuse` plan takes
    ("eval_plans", "seeds_from_seq", "INTEGER"),
    # the channel subdirectories' identities (spec 2.3): NULL until the next enrollment or start records them
    ("workspaces", "subdirs", "TEXT"),
)


def _ensure_additive(c: sqlite3.Connection) -> None:
    """Make every table of _ADMIN_SCHEMA and column of _ADDED_COLUMNS that is missing (in the open transaction)."""
    for stmt in _ADMIN_SCHEMA.split(";"):
        if stmt.strip():
            c.execute(stmt)
    for table, column, kind in _ADDED_COLUMNS:
        if column not in {r[1] for r in c.execute(f"PRAGMA table_info({table})")}:
            c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


def _add_job_resources(c: sqlite3.Connection) -> None:
    """Schema 3: each task's own memory (MB) and CPUs, NULL where its launch asked for none (every older task)."""
    have = {r[1] for r in c.execute("PRAGMA table_info(jobs)")}
    for column in ("mem_mb", "cpus"):
        if column not in have:
            c.execute(f"ALTER TABLE jobs ADD COLUMN {column} INTEGER")


def _add_job_sweeps(c: sqlite3.Connection) -> None:
    """Schema 4: a swept task's values, its launch's rank key and the numbers of its last JSON line, NULL for
    every older task (no sweep, no rank, nothing `history --metric` shows)."""
    have = {r[1] for r in c.execute("PRAGMA table_info(jobs)")}
    for column in ("params", "rank", "metrics"):
        if column not in have:
            c.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT")


def _add_contract_told(c: sqlite3.Connection) -> None:
    """Schema 5: the contract each workspace was last told, none for now (the next answer tells nothing and
    records the contract then)."""
    c.execute(_CONTRACT_SCHEMA)


def _add_job_width(c: sqlite3.Connection) -> None:
    """Schema 6: how many tasks of a launch run at once, NULL for every older task (it was decided at dispatch,
    and is again, as then: channel.decode.at_a_time)."""
    if "width" not in {r[1] for r in c.execute("PRAGMA table_info(jobs)")}:
        c.execute("ALTER TABLE jobs ADD COLUMN width INTEGER")


def _add_sleep_wake_on(c: sqlite3.Connection) -> None:
    """Schema 7: a sleep's wake condition, its `rest` and the task that met the condition, NULL for every older
    sleep (it wakes when all its tasks have ended, as every sleep did)."""
    have = {r[1] for r in c.execute("PRAGMA table_info(sleeps)")}
    for column in ("wake_on", "rest", "woke_by"):
        if column not in have:
            c.execute(f"ALTER TABLE sleeps ADD COLUMN {column} TEXT")


# version -> the step that takes a store at that version to the next one, run in the migrating transaction.
_MIGRATIONS: Final[dict[int, Callable[[sqlite3.Connection], None]]] = {
    1: _ensure_additive,
    2: _add_job_resources,
    3: _add_job_sweeps,
    4: _add_contract_told,
    5: _add_job_width,
    6: _add_sleep_wake_on,
}
assert set(_MIGRATIONS) == set(range(1, SCHEMA_VERSION)), "a step for every version below SCHEMA_VERSION"


def _migrate(c: sqlite3.Connection, version: int) -> None:
    for v in range(version, SCHEMA_VERSION):
        _MIGRATIONS[v](c)
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def backup_name(db: Path, old: int, new: int, at: float) -> Path:
    """Where the copy taken before migrating `db` from schema `old` to `new` goes: beside it, named with both."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at))
    return db.with_name(f"{db.name}.v{old}-before-v{new}.{stamp}.bak")


def backups(db: Path, version: int) -> list[Path]:
    """The backups of `db` taken at schema `version` (before a migration away from it), oldest first."""
    return sorted(db.parent.glob(f"{db.name}.v{version}-before-v*.bak"))


def _release_line() -> str:
    return f"syscall-kernel {release.VERSION} (commit {release.COMMIT or 'unknown'})"


_PLAN_COLS: Final = (
    "workspace, seq, decision, contract, seed, base_commit, base_tree, candidate_commit, candidate_tree, "
    "baseline_key, reused_value, seeds, protected_changed, shadows_removed, seeds_from_seq"
)
# One eval_plans row, in _PLAN_COLS order: reused_value, seeds and protected_changed are JSON lists, and
# shadows_removed a JSON object (kernel.io.submit.Removed); the last four NULL in a row recorded before they
# were added.
EvalPlanValues = tuple[
    str,
    int,
    str,
    bytes,
    int | None,
    str | None,
    str | None,
    str,
    str,
    str | None,
    str | None,
    str | None,
    str | None,
    str | None,
    int | None,
]

T = TypeVar("T")


def timestamp(at: float | None = None) -> str:
    """RFC 3339 UTC with milliseconds, as every protocol message uses."""
    t = time.time() if at is None else at
    whole = time.gmtime(t)
    return time.strftime("%Y-%m-%dT%H:%M:%S", whole) + f".{int((t % 1) * 1000):03d}Z"


_policy_decoder: Final = msgspec.json.Decoder(Policy)
_subdirs_decoder: Final = msgspec.json.Decoder(tuple[tuple[str, int, int], ...])


def _subdirs_of(text: str | None) -> tuple[tuple[str, int, int], ...]:
    return () if text is None else _subdirs_decoder.decode(text)


_artifacts_decoder: Final = msgspec.json.Decoder(tuple[str, ...])
_params_decoder: Final = msgspec.json.Decoder(tuple[tuple[str, str], ...])
_metrics_decoder: Final = msgspec.json.Decoder(dict[str, float])


@dataclass(frozen=True, slots=True)
class AdminRow:
    """The operator's controls of one workspace: paused, unenrolled (records kept), policy overrides."""

    paused_at: str | None = None
    unenrolled_at: str | None = None
    # Policy fields set for this workspace at enrollment (`--max-minutes`, `--max-gpus`, `--network`).
    overrides: dict[str, int | bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BudgetChange:
    workspace: str
    at: str
    who: str
    change: str
    before: Balance
    after: Balance


_overrides_decoder: Final = msgspec.json.Decoder(dict[str, int | bool])
_balance_decoder: Final = msgspec.json.Decoder(Balance)


class StoreError(Exception):
    """The state store cannot be used (wrong schema version, unreadable file)."""


class MigrationHeld(StoreError):
    """The store needs a migration that the caller may not make now (a kernel serves the store)."""


class StoreNewer(StoreError):
    """The store has a newer schema than this kernel reads (a release was rolled back)."""


class Store:
    """The sqlite state store. Use `Store.open`; write only inside `transaction()`."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path
        # Held around every COMMIT: whoever holds it knows no commit is half-way (the service's forced stop takes
        # it, and keeps it, before the process exits).
        self.commit_lock = threading.Lock()
        # Held by every store step (StoreWorker.run_here), whichever thread runs it, and by `close`: sqlite has one
        # writer at a time, and a connection closed while another thread is inside one of its calls is freed
        # under that call (the process crashes). A step that starts after `close` gets sqlite3.ProgrammingError
        # ("Cannot operate on a closed database"): a channel I/O thread given up at stop may still run one.
        self.step_lock = threading.Lock()
        # The WAL, open for `sync_wal` (any thread); reopened if sqlite made a new one.
        self._wal_lock = threading.Lock()
        self._wal_fd: int | None = None
        # The order of this kernel's budget.json writes (kernel.io.budgetorder): stamps taken in store steps.
        self.budget_order = BudgetOrder()
        # (store's schema, SCHEMA_VERSION) when this read-only store reads a migrated copy of an older store.
        self.pending_migration: tuple[int, int] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, readonly: bool = False, migrate: bool = True) -> Store:
        """The store at `path`. Read-write, a store of an older schema is migrated first (a backup beside it,
        `event=store_migrated`), or refused (MigrationHeld) with `migrate=False`, which a command passes while
        a kernel, maybe of an older release, serves the store; read-only, it is read through a migrated copy in
        memory, the file untouched, and `pending_migration` says so. A store of a newer schema is refused
        (StoreNewer) either way."""
        p = Path(path)
        if readonly:
            if not p.exists():
                raise StoreError(f"no state store at {p} (has the kernel run, or a workspace been enrolled?)")
            conn = sqlite3.connect(
                f"file:{p}?mode=ro", uri=True, isolation_level=None, check_same_thread=False, timeout=10
            )
        else:
            # The state dir itself is the caller's (kernel.io.statedir.prepare): never a whole tree made here.
            p.parent.mkdir(exist_ok=True, mode=0o700)
            conn = sqlite3.connect(p, isolation_level=None, check_same_thread=False, timeout=30)
        store = cls(conn, p)
        try:
            store._setup(readonly=readonly, migrate=migrate)
        except BaseException:
            store._conn.close()
            raise
        return store

    def _setup(self, *, readonly: bool, migrate: bool) -> None:
        c = self._conn
        c.execute("PRAGMA busy_timeout = 30000")
        c.execute("PRAGMA foreign_keys = ON")
        if readonly:
            version = self._version()
            if version == 0:
                raise StoreError(
                    f"{self.path}: an empty store (schema version 0): no kernel has written it yet"
                )
            if version < SCHEMA_VERSION:
                self._read_migrated_copy(version)
            return
        mode = c.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(
                f"{self.path}: sqlite refused WAL mode (got {mode}); put state_dir on a local disk"
            )
        # FULL: the WAL is fsynced at every commit, so "committed before the side effect" holds across power loss.
        c.execute("PRAGMA synchronous = FULL")
        if not migrate and 0 < (version := self._version()) < SCHEMA_VERSION:
            raise MigrationHeld(
                f"{self.path} has schema version {version}, which {_release_line()} migrates to "
                f"{SCHEMA_VERSION} only where no kernel serves the store, and a kernel serves it: restart that "
                "kernel with this release (it migrates the store, after a backup), then run this again"
            )
        while True:
            # The backup API cannot read while this connection holds the write lock, so the copy is taken before
            # the migrating transaction, and taken again if another connection committed in between.
            copy = self._backup_if_older()
            with self.transaction():
                version = self._version()
                older = 0 < version < SCHEMA_VERSION
                if copy is not None and (
                    not older or copy[:2] != (version, self._one("PRAGMA data_version")[0])
                ):
                    copy[2].unlink(missing_ok=True)  # not the store this transaction sees
                    copy = None
                if older:
                    if copy is None:
                        continue
                    _migrate(c, version)
                elif version == 0:
                    for stmt in _SCHEMA.split(";"):
                        if stmt.strip():
                            c.execute(stmt)
                    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                # a table or column lost from a store at SCHEMA_VERSION (made by hand) is made again
                _ensure_additive(c)
                self._rekey_legacy()
                if c.execute("SELECT 1 FROM store_meta WHERE name = 'store_id'").fetchone() is None:
                    c.execute(
                        "INSERT INTO store_meta (name, value) VALUES ('store_id', ?)", (uuid.uuid4().hex,)
                    )
                # the release that last wrote it, for an older kernel's refusal to name
                c.execute(
                    "INSERT INTO store_meta (name, value) VALUES ('release', ?) "
                    "ON CONFLICT (name) DO UPDATE SET value = excluded.value WHERE value != excluded.value",
                    (_release_line(),),
                )
            break
        if copy is not None:
            log.event(
                "store_migrated",
                store=str(self.path),
                backup=str(copy[2]),
                release=release.VERSION,
                **{"from": copy[0], "to": SCHEMA_VERSION},
            )

    def _backup_if_older(self) -> tuple[int, int, Path] | None:
        """For a store of an older schema: (its schema, sqlite's data_version before the copy, the backup)."""
        version = self._version()
        if not 0 < version < SCHEMA_VERSION:
            return None
        seen = int(self._one("PRAGMA data_version")[0])
        return version, seen, self._backup(version)

    def _version(self) -> int:
        """The store's schema version; StoreNewer if it is newer than this kernel reads."""
        version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            try:
                row = self._one("SELECT value FROM store_meta WHERE name = 'release'")
            except sqlite3.Error:
                row = None
            wrote = f"written by {row[0]}" if row is not None else "written by a newer release"
            found = backups(self.path, SCHEMA_VERSION)
            restore = (
                f"the newest backup taken at schema {SCHEMA_VERSION} is {found[-1]}"
                if found
                else f"no backup taken at schema {SCHEMA_VERSION} is beside it"
            )
            raise StoreNewer(
                f"{self.path} has schema version {version} ({wrote}); this kernel, {_release_line()}, reads "
                f"schema versions up to {SCHEMA_VERSION}. Install the newer release again, or go back to this "
                f"one by stopping the kernel and copying back over the store the backup its upgrade took "
                f"({restore}; what was done since that upgrade is then forgotten: docs/operator.md, "
                "Upgrading and rolling back)"
            )
        return version

    def _backup(self, version: int) -> Path:
        """A complete copy of the store (sqlite's backup API) beside it, named with `version` and SCHEMA_VERSION,
        durable before it is given its name."""
        final = backup_name(self.path, version, SCHEMA_VERSION, time.time())
        tmp = self.path.with_name(f"{self.path.name}.backup.tmp")
        tmp.unlink(missing_ok=True)
        try:
            dest = sqlite3.connect(tmp)
            try:
                self._conn.backup(dest)
            finally:
                dest.close()
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return final

    def pending_note(self) -> str | None:
        """What `status` and `check` say of a store read through a migrated copy (None: nothing pending)."""
        if self.pending_migration is None:
            return None
        old, new = self.pending_migration
        return (
            f"schema version {old}, older than this kernel's {new}: a migration is pending (the next "
            "`syscall-kernel serve` of this release makes it, after a backup beside the store); shown from a "
            "migrated copy in memory, the store itself untouched"
        )

    def _read_migrated_copy(self, version: int) -> None:
        """Serve reads from an in-memory copy of the store migrated to SCHEMA_VERSION; the file is not written."""
        mem = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        try:
            self._conn.backup(mem)
            mem.execute("PRAGMA foreign_keys = ON")
            mem.execute("BEGIN")
            _migrate(mem, version)
            mem.execute("COMMIT")
        except BaseException:
            mem.close()
            raise
        self._conn.close()
        self._conn = mem
        self.pending_migration = (version, SCHEMA_VERSION)

    def _rekey_legacy(self) -> None:
        """Give every workspace whose key no consumer accepts (an earlier `workspace_key` kept non-ASCII letters
        and a leading `_`, keys the kernel's repository refuses, so serving it crashed) the key
        `workspace_key` makes now, in every table that names it, in the open transaction. Such a workspace never
        got past its enrollment, so nothing on disk is named by its old key."""
        c = self._conn
        stale = [
            (key, path)
            for key, path in c.execute("SELECT key, path FROM workspaces").fetchall()
            if not key_is_safe(key)
        ]
        if not stale:
            return
        c.execute("PRAGMA defer_foreign_keys = ON")
        tables = [
            name
            for (name,) in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
            if "workspace" in {r[1] for r in c.execute(f"PRAGMA table_info({name})")}
        ]
        for old, path in stale:
            new = workspace_key(path)
            c.execute("UPDATE workspaces SET key = ? WHERE key = ?", (new, old))
            for table in tables:
                c.execute(f"UPDATE {table} SET workspace = ? WHERE workspace = ?", (new, old))
            log.event("workspace_rekeyed", logging.WARNING, old=old, new=new, path=path)

    def close(self) -> None:
        """Close the connection once no store step is running (`step_lock`)."""
        with self.step_lock:
            self._conn.close()
        with self._wal_lock:
            if self._wal_fd is not None:
                os.close(self._wal_fd)
                self._wal_fd = None

    def sync_wal(self) -> None:
        """Make every transaction committed so far durable, `transaction(durable=False)` ones included: one fsync
        of the WAL. Safe from any thread (it touches only its own descriptor).

        Why it is enough: a commit has written its frames into the WAL before it returns, so the fsync puts them
        on disk with their commit frame; frames that a checkpoint has moved on were synced into the database file
        by that checkpoint before the WAL was reused (at FULL and NORMAL, sqlite syncs the database after every
        completed checkpoint); no WAL at all means the last connection checkpointed it and removed it."""
        wal = f"{self.path}-wal"
        with self._wal_lock:
            try:
                now = os.stat(wal)
            except FileNotFoundError:
                return
            if self._wal_fd is not None:
                st = os.fstat(self._wal_fd)
                if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                    os.close(self._wal_fd)
                    self._wal_fd = None
            if self._wal_fd is None:
                self._wal_fd = os.open(wal, os.O_RDONLY | os.O_CLOEXEC)
            os.fsync(self._wal_fd)

    def changes(self) -> int:
        """Rows changed by this connection's committed and current statements since it opened."""
        return self._conn.total_changes

    def store_id(self) -> str | None:
        """This store's identity, drawn once when it was made: a channel's kernel.json names the store that owns
        it. None only from a read-only open of a store that no kernel of this version has opened yet."""
        try:
            row = self._one("SELECT value FROM store_meta WHERE name = 'store_id'")
        except sqlite3.OperationalError:
            return None
        return None if row is None else str(row[0])

    @contextlib.contextmanager
    def transaction(self, *, durable: bool = True) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT (durable on return), ROLLBACK on any exception.

        `durable=False` commits without the WAL's fsync (synchronous=NORMAL for this one transaction): the commit
        survives the process being killed, and becomes durable at the next durable commit or `sync_wal`, which
        the caller makes before any side effect that depends on it being durable."""
        if not durable:
            self._conn.execute("PRAGMA synchronous = NORMAL")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                # sqlite has already rolled back after some errors (SQLITE_FULL): a second ROLLBACK would raise
                # and hide the real error.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            with self.commit_lock:
                self._conn.execute("COMMIT")
        finally:
            if not durable:
                self._conn.execute("PRAGMA synchronous = FULL")

    def _one(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql, args).fetchone()

    def _all(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        return self._conn.execute(sql, args).fetchall()

    # --- workspaces ---------------------------------------------------------------------------------------

    _WS_COLS: Final = (
        "key, path, dev, ino, uid, launches, sleeps, gpu_s, reserved_gpu_s, policy, tool_sha256, watch, "
        "enrolled_at, problem, subdirs"
    )

    @staticmethod
    def _ws(row: Any, policies: dict[bytes, Policy] | None = None) -> WorkspaceRow:
        # `policies`: decoded policies by their bytes, shared by the rows of one read (most workspaces have the
        # config's policy: 10,000 rows, a handful of decodes). Policy is frozen, so sharing one is safe.
        policy = None if policies is None else policies.get(row[9])
        if policy is None:
            policy = _policy_decoder.decode(row[9])
            if policies is not None:
                policies[row[9]] = policy
        return WorkspaceRow(
            key=row[0],
            path=row[1],
            identity=Identity(dev=row[2], ino=row[3], uid=row[4], subdirs=_subdirs_of(row[14])),
            balance=Balance(launches=row[5], sleeps=row[6], gpu_s=row[7], reserved_gpu_s=row[8]),
            policy=policy,
            tool_sha256=row[10],
            watch=row[11],
            enrolled_at=row[12],
            problem=row[13],
        )

    def workspace(self, key: str) -> WorkspaceRow | None:
        row = self._one(f"SELECT {self._WS_COLS} FROM workspaces WHERE key = ?", (key,))
        return None if row is None else self._ws(row)

    def workspace_by_path(self, path: str) -> WorkspaceRow | None:
        row = self._one(f"SELECT {self._WS_COLS} FROM workspaces WHERE path = ?", (path,))
        return None if row is None else self._ws(row)

    def workspaces(self) -> list[WorkspaceRow]:
        """The enrolled workspaces (not those unenrolled: their records stay, their channels are gone)."""
        try:
            rows = self._all(
                f"SELECT {self._WS_COLS} FROM workspaces WHERE key NOT IN "
                "(SELECT workspace FROM workspace_admin WHERE unenrolled_at IS NOT NULL) ORDER BY key"
            )
        except sqlite3.OperationalError:  # a read-only store no kernel of this version has opened yet
            rows = self._all(f"SELECT {self._WS_COLS} FROM workspaces ORDER BY key")
        policies: dict[bytes, Policy] = {}
        return [self._ws(r, policies) for r in rows]

    def balances(self) -> list[tuple[str, Balance, bool]]:
        """(key, balance, whether it has a problem) of each enrolled workspace: what the metrics show, without
        the rows' other columns (10,000 of them every few seconds)."""
        cols = "key, launches, sleeps, gpu_s, reserved_gpu_s, problem IS NOT NULL"
        try:
            rows = self._all(
                f"SELECT {cols} FROM workspaces WHERE key NOT IN "
                "(SELECT workspace FROM workspace_admin WHERE unenrolled_at IS NOT NULL)"
            )
        except sqlite3.OperationalError:  # as `workspaces`
            rows = self._all(f"SELECT {cols} FROM workspaces")
        return [(r[0], Balance(r[1], r[2], r[3], r[4]), bool(r[5])) for r in rows]

    def enrolled_keys(self) -> list[str]:
        """The keys of `workspaces()`, without reading their rows (the rescan looks for the few not served)."""
        try:
            rows = self._all(
                "SELECT key FROM workspaces WHERE key NOT IN "
                "(SELECT workspace FROM workspace_admin WHERE unenrolled_at IS NOT NULL) ORDER BY key"
            )
        except sqlite3.OperationalError:  # as `workspaces`
            rows = self._all("SELECT key FROM workspaces ORDER BY key")
        return [r[0] for r in rows]

    def workspace_paths(self) -> set[str]:
        """The path of every workspace the store has a row for, unenrolled ones included (the glob enrolls a
        path only when it has none: an unenrolled workspace is enrolled again only by an operator)."""
        return {r[0] for r in self._all("SELECT path FROM workspaces")}

    # --- operator's controls (workspace_admin, budget_changes) ---------------------------------------------

    def admin(self, key: str) -> AdminRow:
        try:
            row = self._one(
                "SELECT paused_at, unenrolled_at, overrides FROM workspace_admin WHERE workspace=?", (key,)
            )
        except sqlite3.OperationalError:
            row = None
        if row is None:
            return AdminRow()
        overrides = _overrides_decoder.decode(row[2]) if row[2] else {}
        return AdminRow(paused_at=row[0], unenrolled_at=row[1], overrides=overrides)

    def admins(self) -> dict[str, AdminRow]:
        """Every workspace's AdminRow that has one (`admin` of the rest is the default), in one query."""
        try:
            rows = self._all("SELECT workspace, paused_at, unenrolled_at, overrides FROM workspace_admin")
        except sqlite3.OperationalError:
            return {}
        return {
            r[0]: AdminRow(
                paused_at=r[1], unenrolled_at=r[2], overrides=_overrides_decoder.decode(r[3]) if r[3] else {}
            )
            for r in rows
        }

    def set_admin(self, key: str, a: AdminRow) -> None:
        self._conn.execute(
            "INSERT INTO workspace_admin (workspace, paused_at, unenrolled_at, overrides) VALUES (?,?,?,?) "
            "ON CONFLICT(workspace) DO UPDATE SET paused_at=excluded.paused_at, "
            "unenrolled_at=excluded.unenrolled_at, overrides=excluded.overrides",
            (key, a.paused_at, a.unenrolled_at, msgspec.json.encode(a.overrides) if a.overrides else None),
        )

    def paused(self) -> set[str]:
        try:
            return {
                r[0] for r in self._all("SELECT workspace FROM workspace_admin WHERE paused_at IS NOT NULL")
            }
        except sqlite3.OperationalError:
            return set()

    # --- retention (kernel.core.retention decides; the service removes the files) ---------------------------

    # Requests whose rows may go after the retention time: answered read-only questions. A sleep's or cancel's
    # row stays for good (its id may never be reused; a replay gets the same answer).
    READ_ONLY_TYPES: Final = ("status", "queue", "history")

    def sleep_ages(self, key: str) -> list[tuple[int, str, str, str | None]]:
        """(seq, state, created_at, woken_at) of the workspace's sleeps not pruned yet."""
        return [
            (int(r[0]), str(r[1]), str(r[2]), r[3])
            for r in self._all(
                "SELECT seq, state, created_at, woken_at FROM sleeps WHERE workspace=? AND seq NOT IN "
                "(SELECT seq FROM pruned_sleeps WHERE workspace=?) ORDER BY seq",
                (key, key),
            )
        ]

    def record_pruned(self, key: str, seq: int, at: str, run_bytes: int, result_bytes: int) -> None:
        """The sleep's run directory and results are gone: record it, and drop the request's body (its id,
        digest and answer stay, so a replay is still answered the same)."""
        self._conn.execute(
            "INSERT OR REPLACE INTO pruned_sleeps (workspace, seq, pruned_at, run_bytes, result_bytes) "
            "VALUES (?,?,?,?,?)",
            (key, seq, at, run_bytes, result_bytes),
        )
        self._conn.execute("UPDATE requests SET body=NULL WHERE workspace=? AND sleep_seq=?", (key, seq))

    def prune_read_requests(self, key: str, answered_before: str) -> int:
        """Forget answered read-only requests answered before `answered_before` (RFC 3339, as stored)."""
        marks = ",".join("?" * len(self.READ_ONLY_TYPES))
        cur = self._conn.execute(
            f"DELETE FROM requests WHERE workspace=? AND type IN ({marks}) AND answer IS NOT NULL "
            "AND answered_at < ?",
            (key, *self.READ_ONLY_TYPES, answered_before),
        )
        return cur.rowcount

    def pruned_count(self, key: str) -> int:
        try:
            row = self._one("SELECT count(*) FROM pruned_sleeps WHERE workspace=?", (key,))
        except sqlite3.OperationalError:
            return 0
        return 0 if row is None else int(row[0])

    def slurm_account(self, key: str) -> str | None:
        """The workspace's own Slurm account (`enroll --account`), or None (the config's `[slurm] account`)."""
        try:
            row = self._one("SELECT account FROM workspace_slurm WHERE workspace=?", (key,))
        except sqlite3.OperationalError:  # a read-only store no kernel of this version has opened yet
            return None
        return None if row is None else str(row[0])

    def set_slurm_account(self, key: str, account: str | None) -> None:
        if account is None:
            self._conn.execute("DELETE FROM workspace_slurm WHERE workspace=?", (key,))
        else:
            self._conn.execute(
                "INSERT INTO workspace_slurm (workspace, account) VALUES (?,?) "
                "ON CONFLICT(workspace) DO UPDATE SET account=excluded.account",
                (key, account),
            )

    def add_budget_change(
        self, key: str, at: str, who: str, change: str, before: Balance, after: Balance
    ) -> None:
        self._conn.execute(
            "INSERT INTO budget_changes (workspace, at, who, change, before, after) VALUES (?,?,?,?,?,?)",
            (key, at, who, change, msgspec.json.encode(before), msgspec.json.encode(after)),
        )

    def budget_changes(self, key: str | None = None) -> list[BudgetChange]:
        where, args = ("WHERE workspace=?", (key,)) if key is not None else ("", ())
        try:
            rows = self._all(
                f"SELECT workspace, at, who, change, before, after FROM budget_changes {where} ORDER BY rowid",
                args,
            )
        except sqlite3.OperationalError:
            return []
        return [
            BudgetChange(r[0], r[1], r[2], r[3], _balance_decoder.decode(r[4]), _balance_decoder.decode(r[5]))
            for r in rows
        ]

    def put_workspace(self, ws: WorkspaceRow) -> None:
        self._conn.execute(
            f"INSERT INTO workspaces ({self._WS_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
            "ON CONFLICT(key) DO UPDATE SET path=excluded.path, dev=excluded.dev, ino=excluded.ino, "
            "uid=excluded.uid, launches=excluded.launches, sleeps=excluded.sleeps, gpu_s=excluded.gpu_s, "
            "reserved_gpu_s=excluded.reserved_gpu_s, policy=excluded.policy, tool_sha256=excluded.tool_sha256, "
            "watch=excluded.watch, problem=excluded.problem, subdirs=excluded.subdirs",
            (
                ws.key,
                ws.path,
                ws.identity.dev,
                ws.identity.ino,
                ws.identity.uid,
                ws.balance.launches,
                ws.balance.sleeps,
                ws.balance.gpu_s,
                ws.balance.reserved_gpu_s,
                msgspec.json.encode(ws.policy),
                ws.tool_sha256,
                ws.watch,
                ws.enrolled_at,
                ws.problem,
                msgspec.json.encode(ws.identity.subdirs).decode() if ws.identity.subdirs else None,
            ),
        )

    def set_balance(self, key: str, b: Balance) -> None:
        self._conn.execute(
            "UPDATE workspaces SET launches=?, sleeps=?, gpu_s=?, reserved_gpu_s=? WHERE key=?",
            (b.launches, b.sleeps, b.gpu_s, b.reserved_gpu_s, key),
        )

    def owners_seen(self) -> dict[str, tuple[int, int, int, int, int]]:
        """Every workspace's recorded kernel.json fingerprint (dev, ino, size, mtime_ns, ctime_ns)."""
        try:
            rows = self._all("SELECT workspace, dev, ino, size, mtime_ns, ctime_ns FROM owner_seen")
        except sqlite3.OperationalError:  # a read-only store no kernel of this version has opened yet
            return {}
        return {r[0]: (r[1], r[2], r[3], r[4], r[5]) for r in rows}

    def set_owners_seen(self, seen: dict[str, tuple[int, int, int, int, int]]) -> None:
        self._conn.executemany(
            "INSERT OR REPLACE INTO owner_seen (workspace, dev, ino, size, mtime_ns, ctime_ns) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [(k, *v) for k, v in seen.items()],
        )

    def set_problem(self, key: str, problem: str | None) -> None:
        self._conn.execute("UPDATE workspaces SET problem=? WHERE key=?", (problem, key))

    def set_policy(self, key: str, policy: Policy) -> None:
        self._conn.execute("UPDATE workspaces SET policy=? WHERE key=?", (msgspec.json.encode(policy), key))

    def set_watch(self, key: str, watch: str) -> None:
        self._conn.execute("UPDATE workspaces SET watch=? WHERE key=?", (watch, key))

    # --- requests -----------------------------------------------------------------------------------------

    _REQ_COLS: Final = "workspace, id, sha256, type, received_at, sleep_seq, body, answer, answered_at"

    def request(self, workspace: str, request_id: str) -> RequestRow | None:
        row = self._one(
            f"SELECT {self._REQ_COLS} FROM requests WHERE workspace=? AND id=?", (workspace, request_id)
        )
        return None if row is None else RequestRow(*row)

    def insert_request(self, r: RequestRow) -> None:
        self._conn.execute(
            f"INSERT INTO requests ({self._REQ_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                r.workspace,
                r.id,
                r.sha256,
                r.type,
                r.received_at,
                r.sleep_seq,
                r.body,
                r.answer,
                r.answered_at,
            ),
        )

    def contract_told(self, workspace: str) -> bytes | None:
        """The contract last told to the workspace (kernel.core.contract.encoded), None when none was."""
        row = self._one("SELECT contract FROM contract_told WHERE workspace=?", (workspace,))
        return None if row is None else bytes(row[0])

    def set_contract_told(self, workspace: str, contract: bytes) -> None:
        self._one(
            "INSERT INTO contract_told (workspace, contract) VALUES (?,?) "
            "ON CONFLICT(workspace) DO UPDATE SET contract=excluded.contract",
            (workspace, contract),
        )

    def set_answer(self, workspace: str, request_id: str, answer: bytes, at: str) -> None:
        self._conn.execute(
            "UPDATE requests SET answer=?, answered_at=? WHERE workspace=? AND id=?",
            (answer, at, workspace, request_id),
        )

    def unanswered(self) -> list[RequestRow]:
        """Requests recorded but not yet answered (a sleep whose dispatch a crash interrupted)."""
        rows = self._all(f"SELECT {self._REQ_COLS} FROM requests WHERE answer IS NULL ORDER BY received_at")
        return [RequestRow(*r) for r in rows]

    def count_requests(self, workspace: str | None = None) -> int:
        if workspace is None:
            return int(self._one("SELECT count(*) FROM requests")[0])
        return int(self._one("SELECT count(*) FROM requests WHERE workspace=?", (workspace,))[0])

    # --- sleeps -------------------------------------------------------------------------------------------

    _SLEEP_COLS: Final = (
        "workspace, seq, id, state, note, submit, created_at, woken_at, verdict, wake_on, rest, woke_by"
    )

    @staticmethod
    def _sleep_row(row: Any) -> SleepRow:
        workspace, seq, sid, state, note, submit, created_at, woken_at, verdict, wake_on, rest, woke_by = row
        got = json.loads(woke_by) if woke_by else None
        return SleepRow(
            workspace,
            seq,
            sid,
            state,
            note,
            submit,
            created_at,
            woken_at,
            verdict,
            wake_on=int(wake_on) if wake_on and wake_on.isdigit() else (wake_on or "all"),
            rest=rest or "run",
            trigger=None if got is None else (str(got["launch"]), int(got["task"])),
            rest_tasks=() if got is None else tuple((str(x[0]), int(x[1])) for x in got["rest"]),
        )

    def next_seq(self, workspace: str) -> int:
        """After every sleep of this store and the workspace's floor (the seqs its channel showed at enrollment)."""
        return int(
            self._one(
                "SELECT max(coalesce((SELECT max(seq) FROM sleeps WHERE workspace=?), 0), "
                "coalesce((SELECT floor FROM seq_floors WHERE workspace=?), 0)) + 1",
                (workspace, workspace),
            )[0]
        )

    def raise_seq_floor(self, workspace: str, floor: int) -> None:
        if floor > 0:
            self._conn.execute(
                "INSERT INTO seq_floors (workspace, floor) VALUES (?, ?) "
                "ON CONFLICT(workspace) DO UPDATE SET floor = max(floor, excluded.floor)",
                (workspace, floor),
            )

    def insert_sleep(self, s: SleepRow) -> None:
        self._conn.execute(
            f"INSERT INTO sleeps ({self._SLEEP_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                s.workspace,
                s.seq,
                s.id,
                s.state,
                s.note,
                s.submit,
                s.created_at,
                s.woken_at,
                s.verdict,
                None if s.wake_on == "all" else str(s.wake_on),
                None if s.rest == "run" else s.rest,
                None,
            ),
        )

    def sleep(self, workspace: str, seq: int) -> SleepRow | None:
        row = self._one(
            f"SELECT {self._SLEEP_COLS} FROM sleeps WHERE workspace=? AND seq=?", (workspace, seq)
        )
        return None if row is None else self._sleep_row(row)

    def current_sleep(self, workspace: str) -> SleepRow | None:
        """The workspace's sleep that has not ended (woken or rejected), if any."""
        row = self._one(
            f"SELECT {self._SLEEP_COLS} FROM sleeps WHERE workspace=? AND state NOT IN {_SLEEP_ENDED} "
            "ORDER BY seq DESC LIMIT 1",
            (workspace,),
        )
        return None if row is None else self._sleep_row(row)

    def sleeps_in_flight(self, workspace: str) -> list[SleepRow]:
        """The workspace's sleeps in flight for the agent (not yet gathered: channel.lifecycle.SLEEP_OVER_FOR_AGENT),
        oldest first."""
        rows = self._all(
            f"SELECT {self._SLEEP_COLS} FROM sleeps WHERE workspace=? AND state NOT IN {_SLEEP_OVER} ORDER BY seq",
            (workspace,),
        )
        return [self._sleep_row(r) for r in rows]

    def sleep_by_id(self, workspace: str, sleep_id: str) -> SleepRow | None:
        row = self._one(
            f"SELECT {self._SLEEP_COLS} FROM sleeps WHERE workspace=? AND id=?",
            (workspace, sleep_id),
        )
        return None if row is None else self._sleep_row(row)

    def sleeps(self, workspace: str, limit: int) -> list[SleepRow]:
        rows = self._all(
            f"SELECT {self._SLEEP_COLS} FROM sleeps WHERE workspace=? ORDER BY seq DESC LIMIT ?",
            (workspace, limit),
        )
        return [self._sleep_row(r) for r in rows]

    def snapshot_commits(self, workspace: str, seqs: Sequence[int]) -> dict[int, str]:
        """The commit each of these sleeps was snapshotted at, where one was taken (the executor records it in
        its `exec_sleeps` table, absent with `backend = "none"`)."""
        if not seqs:
            return {}
        try:
            rows = self._all(
                f"SELECT seq, commit_id FROM exec_sleeps WHERE workspace=? AND seq IN ({','.join('?' * len(seqs))})",
                (workspace, *seqs),
            )
        except sqlite3.OperationalError:  # no executor table: nothing was ever snapshotted
            return {}
        return {int(seq): str(commit) for seq, commit in rows if commit}

    def set_sleep_trigger(
        self, workspace: str, seq: int, trigger: tuple[str, int], rest: Sequence[tuple[str, int]]
    ) -> bool:
        """Record, once, the task whose end met the sleep's `wake_on` and the tasks still live then (the ones its
        `rest` applies to): True when this call recorded them."""
        woke_by = json.dumps({"launch": trigger[0], "task": trigger[1], "rest": [list(x) for x in rest]})
        cur = self._conn.execute(
            "UPDATE sleeps SET woke_by=? WHERE workspace=? AND seq=? AND woke_by IS NULL",
            (woke_by, workspace, seq),
        )
        return cur.rowcount == 1

    def set_sleep_verdict(self, workspace: str, seq: int, verdict: bytes) -> None:
        self._one("UPDATE sleeps SET verdict=? WHERE workspace=? AND seq=?", (verdict, workspace, seq))

    def live_sleeps(self) -> list[SleepRow]:
        rows = self._all(
            f"SELECT {self._SLEEP_COLS} FROM sleeps WHERE state NOT IN {_SLEEP_ENDED} ORDER BY workspace, seq"
        )
        return [self._sleep_row(r) for r in rows]

    def advance_sleep(
        self, workspace: str, seq: int, frm: SleepState, event: SleepEvent, *, woken_at: str | None = None
    ) -> bool:
        """Move the sleep from `frm` by `event`, through the lifecycle table only (compare-and-set): True when it
        was in `frm` and moved, False when it was not in `frm` (someone else moved it first; nothing changed).
        IllegalTransition (a kernel bug) when the table has no such move, whatever the sleep's state."""
        to = next_sleep_state(frm, event)
        cur = self._conn.execute(
            "UPDATE sleeps SET state=?, woken_at=coalesce(?, woken_at) WHERE workspace=? AND seq=? AND state=?",
            (to, woken_at, workspace, seq, frm),
        )
        return cur.rowcount == 1

    # --- execution (exec_sleeps) ------------------------------------------------------------------------

    def exec_sleep(self, workspace: str, seq: int) -> ExecSleepRow | None:
        row = self._one(
            "SELECT ref, commit_id, tree, wake_json, wake_md, released FROM exec_sleeps WHERE workspace=? AND seq=?",
            (workspace, seq),
        )
        return (
            None
            if row is None
            else ExecSleepRow(workspace, seq, row[0], row[1], row[2], row[3], row[4], bool(row[5]))
        )

    def record_snapshot(self, workspace: str, seq: int, ref: str, commit: str, tree: str) -> None:
        self._one(
            "INSERT OR REPLACE INTO exec_sleeps (workspace, seq, ref, commit_id, tree) VALUES (?,?,?,?,?)",
            (workspace, seq, ref, commit, tree),
        )

    def record_wake(self, workspace: str, seq: int, ref: str, wake_json: bytes, wake_md: bytes) -> None:
        """Keep a gathered wake's exact bytes until they are written (the snapshot, if recorded, is kept)."""
        self._one(
            "INSERT INTO exec_sleeps (workspace, seq, ref, commit_id, tree, wake_json, wake_md) "
            "VALUES (?,?,?,'','',?,?) ON CONFLICT(workspace, seq) DO UPDATE SET "
            "wake_json=excluded.wake_json, wake_md=excluded.wake_md",
            (workspace, seq, ref, wake_json, wake_md),
        )

    def unreleased_snapshots(self) -> list[tuple[str, int]]:
        """(workspace, seq) of finished sleeps (woken or rejected) whose snapshot is not released yet."""
        rows = self._all(
            "SELECT e.workspace, e.seq FROM exec_sleeps e JOIN sleeps s ON s.workspace = e.workspace "
            f"AND s.seq = e.seq WHERE e.released = 0 AND s.state IN {_SLEEP_ENDED}"
        )
        return [(str(r[0]), int(r[1])) for r in rows]

    def mark_released(self, workspace: str, seq: int) -> None:
        self._one("UPDATE exec_sleeps SET released = 1 WHERE workspace=? AND seq=?", (workspace, seq))

    def drop_wake_bytes(self, workspace: str, seq: int) -> None:
        """Forget a woken sleep's stored wake bytes (they served only to (re)write the wake, now on disk)."""
        self._one(
            "UPDATE exec_sleeps SET wake_json=NULL, wake_md=NULL WHERE workspace=? AND seq=? AND EXISTS "
            "(SELECT 1 FROM sleeps WHERE workspace=? AND seq=? AND state=?)",
            (workspace, seq, workspace, seq, _WOKEN),
        )

    def data_version(self) -> int:
        """Changes when another connection (an `enroll` process) commits to the store."""
        return int(self._one("PRAGMA data_version")[0])

    # --- submit (eval_*; kernel.io.submit encodes and decodes) ----------------------------------------------

    def eval_base(self, workspace: str) -> tuple[str | None, str | None] | None:
        """(base_commit, base_tree) as recorded; None when the workspace has no eval_workspaces row."""
        row = self._one("SELECT base_commit, base_tree FROM eval_workspaces WHERE workspace=?", (workspace,))
        return None if row is None else (row[0], row[1])

    def set_pending_eval_base(self, workspace: str, commit: str, at: str) -> None:
        """Record `commit` as the base not held yet, only when no base is recorded."""
        self._one(
            "INSERT INTO eval_workspaces (workspace, base_commit, base_set_at) VALUES (?,?,?) "
            "ON CONFLICT(workspace) DO UPDATE SET base_commit=excluded.base_commit, base_tree=NULL, "
            "base_set_at=excluded.base_set_at WHERE eval_workspaces.base_commit IS NULL",
            (workspace, commit, at),
        )

    def set_eval_base(self, workspace: str, commit: str, tree: str, at: str) -> None:
        self._one(
            "INSERT INTO eval_workspaces (workspace, base_commit, base_tree, base_set_at) VALUES (?,?,?,?) "
            "ON CONFLICT(workspace) DO UPDATE SET base_commit=excluded.base_commit, base_tree=excluded.base_tree, "
            "base_set_at=excluded.base_set_at",
            (workspace, commit, tree, at),
        )

    def eval_contract(self, workspace: str) -> bytes | None:
        row = self._one("SELECT contract FROM eval_workspaces WHERE workspace=?", (workspace,))
        return None if row is None or row[0] is None else bytes(row[0])

    def eval_contracts(self) -> dict[str, bytes]:
        """Every workspace's own eval contract (`eval_contract` of each, in one query)."""
        rows = self._all("SELECT workspace, contract FROM eval_workspaces WHERE contract IS NOT NULL")
        return {r[0]: bytes(r[1]) for r in rows}

    def set_eval_contract(self, workspace: str, contract: bytes) -> None:
        self._one(
            "INSERT INTO eval_workspaces (workspace, contract) VALUES (?,?) "
            "ON CONFLICT(workspace) DO UPDATE SET contract=excluded.contract",
            (workspace, contract),
        )

    def eval_plan(self, workspace: str, seq: int) -> EvalPlanValues | None:
        row = self._one(
            f"SELECT {_PLAN_COLS} FROM eval_plans WHERE workspace=? AND seq=?",
            (workspace, seq),
        )
        return None if row is None else tuple(row)

    def put_eval_plan(self, values: EvalPlanValues) -> None:
        self._one(f"INSERT INTO eval_plans ({_PLAN_COLS}) VALUES ({','.join('?' * len(values))})", values)

    def eval_measurement(self, key: str) -> tuple[str, str, int] | None:
        """(seeds, values, the seq of the submit that measured it) of a stored base measurement (seeds and values
        JSON lists)."""
        row = self._one("SELECT seeds, vals, seq FROM eval_measurements WHERE key=?", (key,))
        return None if row is None else (str(row[0]), str(row[1]), int(row[2]))

    def eval_disclosure(self, workspace: str) -> tuple[str, int, float | None] | None:
        """(best, spent, noisy_threshold) of the workspace's disclosure state (kernel.core.disclosure.State)."""
        row = self._one(
            "SELECT best, spent, noisy_threshold FROM eval_disclosure WHERE workspace=?", (workspace,)
        )
        return None if row is None else (str(row[0]), int(row[1]), row[2])

    def put_eval_disclosure(
        self, workspace: str, best: str, spent: int, noisy_threshold: float | None
    ) -> None:
        self._one(
            "INSERT INTO eval_disclosure (workspace, best, spent, noisy_threshold) VALUES (?,?,?,?) "
            "ON CONFLICT(workspace) DO UPDATE SET best=excluded.best, spent=excluded.spent, "
            "noisy_threshold=excluded.noisy_threshold",
            (workspace, best, spent, noisy_threshold),
        )

    def submits_since(self, workspace: str, since: str) -> tuple[int, str | None]:
        """How many sleeps carrying a submit the workspace has had accepted at or after `since`, and when the
        oldest of them was. Not counted: rejected ones, and those gathered with no verdict (none of their runs
        ran: their environment build failed, `Waker.wake_unrun`; a judged submit has its verdict recorded in the
        transaction that gathers it)."""
        row = self._one(
            "SELECT COUNT(*), MIN(created_at) FROM sleeps WHERE workspace=? AND submit IS NOT NULL "
            "AND state != 'rejected' AND NOT (state IN ('gathered', 'woken') AND verdict IS NULL) "
            "AND created_at >= ?",
            (workspace, since),
        )
        assert row is not None
        return int(row[0]), None if row[1] is None else str(row[1])

    def put_eval_measurement(
        self, key: str, seeds: str, vals: str, workspace: str, seq: int, at: str
    ) -> None:
        """Keep the first measurement of `key` (a later one with the same key is ignored)."""
        self._one(
            "INSERT OR IGNORE INTO eval_measurements (key, seeds, vals, workspace, seq, measured_at) "
            "VALUES (?,?,?,?,?,?)",
            (key, seeds, vals, workspace, seq, at),
        )

    def put_eval_verdict(
        self,
        workspace: str,
        seq: int,
        sleep_id: str,
        outcome: str,
        verdict: bytes,
        report: str,
        at: str,
        hook: str,
    ) -> None:
        self._one(
            "INSERT OR REPLACE INTO eval_verdicts (workspace, seq, sleep_id, outcome, verdict, report, created_at, "
            "hook_status) VALUES (?,?,?,?,?,?,?,?)",
            (workspace, seq, sleep_id, outcome, verdict, report, at, hook),
        )

    def eval_verdicts(
        self, *, workspace: str | None = None, hook_pending: bool = False
    ) -> list[tuple[str, int, str, bytes, str, str]]:
        """(workspace, seq, sleep_id, verdict, report, hook_status) in the order they were recorded."""
        sql = "SELECT workspace, seq, sleep_id, verdict, report, hook_status FROM eval_verdicts"
        where: list[str] = []
        args: list[str] = []
        if workspace is not None:
            where.append("workspace=?")
            args.append(workspace)
        if hook_pending:
            where.append("hook_status='pending'")
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in self._all(sql + " ORDER BY created_at", args)]

    def set_eval_hook_status(self, workspace: str, seq: int, status: str) -> None:
        self._one(
            "UPDATE eval_verdicts SET hook_status=? WHERE workspace=? AND seq=?", (status, workspace, seq)
        )

    # --- jobs ---------------------------------------------------------------------------------------------

    _JOB_COLS: Final = (
        "workspace, seq, launch, task, array_size, concurrency, command, minutes, gpus, artifacts, why, "
        "reserved_gpu_s, state, backend, job_id, exit_code, signal, started_at, ended_at, run_dir, updated_at, "
        "mem_mb, cpus, params, rank, metrics, width"
    )

    @staticmethod
    def _job(row: Any) -> JobRow:
        values = list(row)
        values[9] = _artifacts_decoder.decode(values[9])
        values[23] = () if values[23] is None else _params_decoder.decode(values[23])
        values[25] = {} if values[25] is None else _metrics_decoder.decode(values[25])
        return JobRow(*values)

    def insert_jobs(self, jobs: Sequence[JobRow]) -> None:
        """Record a sleep's tasks. Every task starts in the lifecycle's first state (PENDING); any other state
        is IllegalTransition (a kernel bug: a state is reached only through `advance_task`)."""
        for j in jobs:
            if j.state != FIRST_TASK_STATE:
                raise IllegalTransition(
                    f"task {j.launch}[{j.task}] of sleep {j.seq} recorded as {j.state!r}, not {FIRST_TASK_STATE!r}"
                )
        self._conn.executemany(
            f"INSERT INTO jobs ({self._JOB_COLS}) VALUES ({','.join('?' * 27)})",
            [
                (
                    j.workspace,
                    j.seq,
                    j.launch,
                    j.task,
                    j.array_size,
                    j.concurrency,
                    j.command,
                    j.minutes,
                    j.gpus,
                    msgspec.json.encode(j.artifacts),
                    j.why,
                    j.reserved_gpu_s,
                    j.state,
                    j.backend,
                    j.job_id,
                    j.exit_code,
                    j.signal,
                    j.started_at,
                    j.ended_at,
                    j.run_dir,
                    j.updated_at,
                    j.mem_mb,
                    j.cpus,
                    msgspec.json.encode(j.params).decode() if j.params else None,
                    j.rank,
                    msgspec.json.encode(dict(j.metrics)).decode() if j.metrics else None,
                    j.width,
                )
                for j in jobs
            ],
        )

    def jobs_of(self, workspace: str, seq: int) -> list[JobRow]:
        rows = self._all(
            f"SELECT {self._JOB_COLS} FROM jobs WHERE workspace=? AND seq=? ORDER BY rowid", (workspace, seq)
        )
        return [self._job(r) for r in rows]

    def live_jobs(self) -> list[JobRow]:
        rows = self._all(
            f"SELECT {self._JOB_COLS} FROM jobs WHERE state IN {_LIVE_TASKS} ORDER BY workspace, seq, rowid"
        )
        return [self._job(r) for r in rows]

    def advance_task(
        self,
        workspace: str,
        seq: int,
        launch: str,
        task: int,
        frm: TaskState,
        event: TaskEvent,
        outcome: TaskState | None = None,
        *,
        at: str,
        started_at: str | None = None,
        ended_at: str | None = None,
        exit_code: int | None = None,
        signal: int | None = None,
        run_dir: str | None = None,
        release: bool = False,
    ) -> bool:
        """Move the task from `frm` by `event` (into `outcome` where the event allows several), through the
        lifecycle table only (compare-and-set): True when it was in `frm` and moved, False when it was not (someone
        else moved it first; nothing changed). IllegalTransition (a kernel bug) when the table has no such move,
        whatever the task's state. `at` is the kernel's record of the change (`updated_at`); the other fields are
        written when given; `release` zeroes the task's reservation, which the caller's ledger decision has
        refunded in the same transaction."""
        to = next_task_state(frm, event, outcome)
        cur = self._conn.execute(
            "UPDATE jobs SET state=?, updated_at=?, started_at=coalesce(?, started_at), "
            "ended_at=coalesce(?, ended_at), exit_code=coalesce(?, exit_code), signal=coalesce(?, signal), "
            "run_dir=coalesce(?, run_dir), reserved_gpu_s=CASE WHEN ? THEN 0 ELSE reserved_gpu_s END "
            "WHERE workspace=? AND seq=? AND launch=? AND task=? AND state=?",
            (
                to,
                at,
                started_at,
                ended_at,
                exit_code,
                signal,
                run_dir,
                release,
                workspace,
                seq,
                launch,
                task,
                frm,
            ),
        )
        return cur.rowcount == 1

    def place_job(
        self,
        workspace: str,
        seq: int,
        launch: str,
        task: int,
        *,
        backend: str,
        job_id: str,
        run_dir: str,
        at: str,
    ) -> bool:
        """Record where a task was handed (its backend, job id and run directory); its state is left alone. Only a
        task not placed yet is placed (compare-and-set on the job id): False when it already was."""
        cur = self._conn.execute(
            "UPDATE jobs SET backend=?, job_id=?, run_dir=?, updated_at=? "
            "WHERE workspace=? AND seq=? AND launch=? AND task=? AND job_id IS NULL",
            (backend, job_id, run_dir, at, workspace, seq, launch, task),
        )
        return cur.rowcount == 1

    def release_job(self, workspace: str, seq: int, launch: str, task: int) -> bool:
        """Zero a task's reservation at its sleep's gather (the caller's `ledger.settle_task` released it in the
        same transaction); its state and `updated_at` (the kernel's record of its last state change) are left
        alone. False when it held nothing."""
        cur = self._conn.execute(
            "UPDATE jobs SET reserved_gpu_s=0 WHERE workspace=? AND seq=? AND launch=? AND task=? "
            "AND reserved_gpu_s > 0",
            (workspace, seq, launch, task),
        )
        return cur.rowcount == 1

    def set_job_metrics(
        self, workspace: str, seq: int, launch: str, task: int, metrics: Mapping[str, float]
    ) -> None:
        """Record the numbers of a task's last JSON line at its sleep's gather (what `history --metric` reads)."""
        self._conn.execute(
            "UPDATE jobs SET metrics=? WHERE workspace=? AND seq=? AND launch=? AND task=?",
            (msgspec.json.encode(dict(metrics)).decode() if metrics else None, workspace, seq, launch, task),
        )

    def state_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(sleeps by state, tasks by state) for the metrics."""
        sleeps = {r[0]: int(r[1]) for r in self._all("SELECT state, count(*) FROM sleeps GROUP BY state")}
        tasks = {r[0]: int(r[1]) for r in self._all("SELECT state, count(*) FROM jobs GROUP BY state")}
        return sleeps, tasks

    def counts(self) -> dict[str, int]:
        """Figures for STATUS= lines and `syscall-kernel status`."""
        return {
            "workspaces": int(self._one("SELECT count(*) FROM workspaces")[0]),
            "requests": int(self._one("SELECT count(*) FROM requests")[0]),
            "live_sleeps": int(
                self._one(f"SELECT count(*) FROM sleeps WHERE state NOT IN {_SLEEP_ENDED}")[0]
            ),
            "live_jobs": int(self._one(f"SELECT count(*) FROM jobs WHERE state IN {_LIVE_TASKS}")[0]),
        }


class StoreUnavailable(StoreError):
    """The store cannot be written now (disk full, I/O error): nothing of the step was committed, so nothing of
    it may be answered; it is tried again later. Logged (at err) by the StoreWorker that saw it."""


# sqlite's primary result codes that mean "the disk failed us", not "this code is wrong".
_DISK_CODES: Final = frozenset({10, 13, 14})  # SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN


def disk_failure(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) and code is not None and (code & 0xFF) in _DISK_CODES


class StoreWorker:
    """Runs store work on one worker thread at a time, off the event loop (an fsync must not stall it).

    A step that fails because the disk failed (full, I/O error) raises StoreUnavailable; the worker then reports
    `failing` (the service's `degraded` state) until a later step commits a change again."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._limiter = anyio.CapacityLimiter(1)
        self.failing: str | None = None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker; it may use `self.store`. Not abandoned on cancel, so a started step always
        finishes (and commits or rolls back) before shutdown proceeds."""
        return await anyio.to_thread.run_sync(self.run_here, fn, *args, limiter=self._limiter)

    def run_here(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the calling thread (a worker thread, never the event loop), serialised with every
        other store step by the worker's lock: a channel I/O thread's store step without two hops through the
        event loop. A step uses sqlite and memory only (kernel.io.stepguard): every other step waits for it."""
        with self.store.step_lock:
            stepguard.enter()
            try:
                return self._guarded(fn, *args)
            finally:
                stepguard.leave()

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        before = self.store.changes()
        try:
            result = fn(*args)
        except sqlite3.OperationalError as exc:
            if not disk_failure(exc):
                raise
            if self.failing != str(exc):
                log.event("store_write_failed", logging.ERROR, store=str(self.store.path), error=str(exc))
            self.failing = str(exc)
            raise StoreUnavailable(f"{self.store.path}: {exc}") from exc
        if self.failing is not None and self.store.changes() != before:
            log.event("store_recovered", store=str(self.store.path), was=self.failing)
            self.failing = None
        return result
