"""Submit's durable state: each workspace's base commit and seed, the per-sleep plan, verdicts and baselines.

Tables (created on demand next to the core schema, like the executor's):
- `eval_workspaces`: the recorded base commit and tree (HEAD at enrollment; moved only by the operator with
  `syscall-kernel rebase`), the private seed, drawn per base (the first time it is needed, and again at every
  rebase: the agent sees it in verdicts), and the workspace's own eval contract when the operator gave one at
  enrollment (else `[defaults.submit]` applies).
- `eval_plans`: what dispatch decided for a sleep's submit, recorded with the snapshot's commit and tree before
  any evaluation runs: `run` (both sides), `reuse` (the base value comes from `eval_baselines`), `unchanged`
  (candidate tree == base tree) or `no_base` (nothing recorded to compare against). The contract as it was then
  is kept with it, so the verdict is judged by the contract that ran.
- `eval_verdicts`: every verdict with the agent's report, and the `on_verdict` hook's status.
- `eval_baselines`: finished base measurements keyed by `evaluate.baseline_key` (exact decimal text).

Git is run only to resolve the base commit and to hold it under the kernel ref `refs/syscall/<key>/base` (so
history the agent rewrites, followed by `git gc`, cannot remove it), with the same neutralised environment as
snapshots.
"""

from __future__ import annotations

import re
import secrets
import subprocess
from dataclasses import dataclass
from decimal import Decimal
from typing import Final, Literal

import msgspec

from channel.messages import EvalContract, Policy, Verdict, encode
from kernel.io.snapshot import REF_PREFIX, git_argv, git_env, snapshot_ref
from kernel.io.store import Store, timestamp

Decision = Literal["run", "reuse", "unchanged", "no_base"]
SEED_BOUND: Final = 2**31

_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS eval_workspaces (
    workspace   TEXT PRIMARY KEY,
    base_commit TEXT,
    base_tree   TEXT,
    base_set_at TEXT,
    seed        INTEGER,
    contract    BLOB
) STRICT""",
    """CREATE TABLE IF NOT EXISTS eval_plans (
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
) STRICT""",
    """CREATE TABLE IF NOT EXISTS eval_verdicts (
    workspace   TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    sleep_id    TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    verdict     BLOB NOT NULL,
    report      TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    hook_status TEXT NOT NULL,
    PRIMARY KEY (workspace, seq)
) STRICT""",
    """CREATE TABLE IF NOT EXISTS eval_baselines (
    key         TEXT PRIMARY KEY,
    value       TEXT NOT NULL,
    workspace   TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    measured_at TEXT NOT NULL
) STRICT""",
)

_contract_decoder: Final = msgspec.json.Decoder(EvalContract)
_verdict_decoder: Final = msgspec.json.Decoder(Verdict)


_OID: Final = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")


class BaseError(Exception):
    """The base commit cannot be resolved in the workspace."""


def ensure_schema(store: Store) -> None:
    with store.transaction():
        for stmt in _SCHEMA:
            store._one(stmt)


# --- base commit and seed -----------------------------------------------------------------------------------


def resolve_commit(workspace: str, rev: str = "HEAD") -> tuple[str, str] | None:
    """(commit, tree) of `rev` in the workspace's repository; None when HEAD has no commit yet."""
    if rev.startswith("-"):
        raise BaseError(f"{rev!r} is not a revision")
    env = git_env(workspace)
    found = []
    for peel in ("commit", "tree"):
        out = subprocess.run(
            git_argv("rev-parse", "--verify", "--end-of-options", f"{rev}^{{{peel}}}"),
            cwd=workspace,
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if out.returncode != 0:
            if rev == "HEAD":
                return None
            first = out.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
            raise BaseError(
                f"{rev!r} is not a commit of {workspace}: {first[0] if first else out.returncode}"
            )
        found.append(out.stdout.decode().strip())
    return found[0], found[1]


def base_ref(key: str) -> str:
    """The kernel ref that keeps a workspace's base commit (and so its objects) in the repository."""
    snapshot_ref(key, 0)  # the same check of the key as one safe ref component
    return f"{REF_PREFIX}/{key}/base"


def _git(workspace: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        git_argv(*args),
        cwd=workspace,
        env=git_env(workspace),
        capture_output=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def held_base(workspace: str, key: str) -> str | None:
    """The commit the base ref holds now (None when there is no such ref)."""
    out = _git(workspace, "rev-parse", "--verify", "-q", "--end-of-options", f"{base_ref(key)}^{{commit}}")
    return (out.stdout.decode().strip() or None) if out.returncode == 0 else None


def hold_base(workspace: str, key: str, commit: str) -> None:
    """Point the base ref at `commit`: created if missing, else moved from the value just read, so a concurrent
    change of the ref makes this fail instead of being overwritten. `--no-deref`: a ref the agent turned into a
    symbolic one is replaced, never followed to move one of the agent's own branches."""
    if not _OID.fullmatch(commit) or not commit.strip("0"):
        # (the all-zero id would make update-ref delete the ref)
        raise BaseError(f"{commit!r} is not a commit id")
    ref = base_ref(key)
    old = _git(workspace, "rev-parse", "--verify", "-q", "--end-of-options", ref)
    current = old.stdout.decode().strip() if old.returncode == 0 else ""
    if current == commit:
        return
    out = _git(
        workspace, "update-ref", "--no-deref", "-m", "syscall-kernel submit base", ref, commit, current
    )
    if out.returncode != 0:
        first = out.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
        raise BaseError(
            f"cannot hold the base {commit[:12]} under {ref} in {workspace}: {first[0] if first else out.returncode}"
        )


def base_of(store: Store, workspace: str) -> tuple[str, str] | None:
    row = store._one("SELECT base_commit, base_tree FROM eval_workspaces WHERE workspace=?", (workspace,))
    return None if row is None or row[0] is None else (row[0], row[1])


def set_base(store: Store, workspace: str, commit: str, tree: str) -> None:
    """Record the base (in the caller's transaction)."""
    store._one(
        "INSERT INTO eval_workspaces (workspace, base_commit, base_tree, base_set_at) VALUES (?,?,?,?) "
        "ON CONFLICT(workspace) DO UPDATE SET base_commit=excluded.base_commit, base_tree=excluded.base_tree, "
        "base_set_at=excluded.base_set_at",
        (workspace, commit, tree, timestamp()),
    )


def rebase(store: Store, workspace: str, commit: str, tree: str) -> int:
    """Move the base and draw a new private seed (in the caller's transaction); returns the seed.

    The seed is per base: the agent has seen the old one in verdicts, and a stored baseline is keyed by its seed,
    so a rebase starts with nothing reused."""
    set_base(store, workspace, commit, tree)
    row = store._one("SELECT seed FROM eval_workspaces WHERE workspace=?", (workspace,))
    old = None if row is None else row[0]
    seed = secrets.randbelow(SEED_BOUND)
    while seed == old:
        seed = secrets.randbelow(SEED_BOUND)
    store._one("UPDATE eval_workspaces SET seed=? WHERE workspace=?", (seed, workspace))
    return seed


def contract_of(store: Store, workspace: str) -> EvalContract | None:
    """The contract the operator gave this workspace at enrollment (None: the config's default applies)."""
    row = store._one("SELECT contract FROM eval_workspaces WHERE workspace=?", (workspace,))
    return None if row is None or row[0] is None else _contract_decoder.decode(row[0])


def set_contract(store: Store, workspace: str, contract: EvalContract) -> None:
    store._one(
        "INSERT INTO eval_workspaces (workspace, contract) VALUES (?,?) "
        "ON CONFLICT(workspace) DO UPDATE SET contract=excluded.contract",
        (workspace, msgspec.json.encode(contract)),
    )


def effective_policy(store: Store, workspace: str, defaults: Policy) -> Policy:
    """The config's policy with the workspace's own contract, if it has one."""
    own = contract_of(store, workspace)
    return defaults if own is None else msgspec.structs.replace(defaults, submit=own)


def seed_of(store: Store, workspace: str) -> int:
    """The workspace's private seed, drawn and stored the first time (in the caller's transaction)."""
    row = store._one("SELECT seed FROM eval_workspaces WHERE workspace=?", (workspace,))
    if row is not None and row[0] is not None:
        return int(row[0])
    seed = secrets.randbelow(SEED_BOUND)
    store._one(
        "INSERT INTO eval_workspaces (workspace, seed) VALUES (?,?) "
        "ON CONFLICT(workspace) DO UPDATE SET seed=excluded.seed",
        (workspace, seed),
    )
    return seed


# --- plans ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    workspace: str
    seq: int
    decision: Decision
    contract: EvalContract
    seed: int | None
    base_commit: str | None
    base_tree: str | None
    candidate_commit: str
    candidate_tree: str
    baseline_key: str | None
    reused_value: Decimal | None


def plan_of(store: Store, workspace: str, seq: int) -> Plan | None:
    row = store._one(
        "SELECT decision, contract, seed, base_commit, base_tree, candidate_commit, candidate_tree, "
        "baseline_key, reused_value FROM eval_plans WHERE workspace=? AND seq=?",
        (workspace, seq),
    )
    if row is None:
        return None
    return Plan(
        workspace,
        seq,
        row[0],
        _contract_decoder.decode(row[1]),
        row[2],
        row[3],
        row[4],
        row[5],
        row[6],
        row[7],
        None if row[8] is None else Decimal(row[8]),
    )


def put_plan(store: Store, p: Plan) -> None:
    store._one(
        "INSERT INTO eval_plans (workspace, seq, decision, contract, seed, base_commit, base_tree, "
        "candidate_commit, candidate_tree, baseline_key, reused_value) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (
            p.workspace,
            p.seq,
            p.decision,
            msgspec.json.encode(p.contract),
            p.seed,
            p.base_commit,
            p.base_tree,
            p.candidate_commit,
            p.candidate_tree,
            p.baseline_key,
            None if p.reused_value is None else str(p.reused_value),
        ),
    )


# --- baselines and verdicts -------------------------------------------------------------------------------


def baseline(store: Store, key: str) -> Decimal | None:
    row = store._one("SELECT value FROM eval_baselines WHERE key=?", (key,))
    return None if row is None else Decimal(row[0])


def put_baseline(store: Store, key: str, value: Decimal, workspace: str, seq: int) -> None:
    store._one(
        "INSERT OR IGNORE INTO eval_baselines (key, value, workspace, seq, measured_at) VALUES (?,?,?,?,?)",
        (key, str(value), workspace, seq, timestamp()),
    )


def put_verdict(
    store: Store, workspace: str, seq: int, sleep_id: str, verdict: Verdict, report: str, hook: bool
) -> None:
    store._one(
        "INSERT OR REPLACE INTO eval_verdicts (workspace, seq, sleep_id, outcome, verdict, report, created_at, "
        "hook_status) VALUES (?,?,?,?,?,?,?,?)",
        (
            workspace,
            seq,
            sleep_id,
            verdict.outcome,
            encode(verdict),
            report,
            timestamp(),
            "pending" if hook else "none",
        ),
    )


@dataclass(frozen=True, slots=True)
class StoredVerdict:
    workspace: str
    seq: int
    sleep_id: str
    verdict: Verdict
    report: str
    hook_status: str


def verdicts(
    store: Store, *, workspace: str | None = None, hook_pending: bool = False
) -> list[StoredVerdict]:
    sql = "SELECT workspace, seq, sleep_id, verdict, report, hook_status FROM eval_verdicts"
    where, args = [], []
    if workspace is not None:
        where.append("workspace=?")
        args.append(workspace)
    if hook_pending:
        where.append("hook_status='pending'")
    if where:
        sql += " WHERE " + " AND ".join(where)
    rows = store._all(sql + " ORDER BY created_at", args)
    return [StoredVerdict(r[0], r[1], r[2], _verdict_decoder.decode(r[3]), r[4], r[5]) for r in rows]


def set_hook_status(store: Store, workspace: str, seq: int, status: str) -> None:
    with store.transaction():
        store._one(
            "UPDATE eval_verdicts SET hook_status=? WHERE workspace=? AND seq=?",
            (status[:500], workspace, seq),
        )
