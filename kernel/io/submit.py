"""Submit's durable state: each workspace's base commit and seed, the per-sleep plan, verdicts and baselines.

Tables (made by the store's migrations, kernel.io.store; read and written here only through its `eval_*` methods):
- `eval_workspaces`: the recorded base commit and tree (HEAD at enrollment; moved only by the operator with
  `syscall-kernel rebase`), and the workspace's own eval contract when the operator gave one at enrollment
  (else `[defaults.submit]` applies). (Its `seed` column is no longer used: seeds are drawn per submit.)
- `eval_plans`: what dispatch decided for a sleep's submit, recorded with the snapshot's commit and tree before
  any evaluation runs: `run` (both sides), `reuse` (the base values come from `eval_measurements`), `unchanged`
  (candidate tree == base tree) or `no_base` (nothing recorded to compare against). The contract as it was then
  is kept with it, so the verdict is judged by the contract that ran; so are the private seeds (`seeds`, a JSON
  list: fresh for every submit, or the reused measurement's), which the agent never sees: its verdict carries
  `evaluate.seed_commitment(seeds, base_tree)`, which the operator can recompute from this row.
- `eval_verdicts`: every verdict with the agent's report, and the `on_verdict` hook's status.
- `eval_measurements`: finished base measurements (one decimal per seed) keyed by `evaluate.baseline_key`,
  with the seeds they were measured with and the submit that measured them; a `reuse` plan (the operator's
  `[verdicts] reuse_base = "same-seeds"`) records that submit's seq, which its verdict names.
- `eval_disclosure`: each workspace's disclosure state (kernel.core.disclosure.State: the ladder's best,
  thresholdout's spent budget and noisy threshold), updated in the gather transaction that records the verdict
  it disclosed, so a crash never discloses without spending, nor spends without the verdict.

The base is taken from the agent's `.git` only through `kernel.io.repo.import_base` (a copy read without links,
every object re-hashed) and held in the kernel's own repository of the workspace under `refs/bases/<tree>`, so
nothing the agent does to its history, objects or refs afterwards changes what the base evaluation runs. The
recorded `base_tree` is the tree id the kernel's repository computed; a `base_commit` with no `base_tree` is a
base recorded (HEAD at enrollment) whose import was refused so far: it is retried before each submit, and a
submit is refused (`snapshot.failed`, nothing charged) while it cannot be taken.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from decimal import Decimal
from typing import Final, Literal

import msgspec

from channel.messages import EvalContract, Policy, SidePath, Verdict, encode
from kernel.core import disclosure as D
from kernel.io import repo as R
from kernel.io.store import Store, timestamp
from kernel.node.wrapper import is_protected, shadowing

Decision = Literal["run", "reuse", "unchanged", "no_base"]
SEED_BOUND: Final = 2**31

_contract_decoder: Final = msgspec.json.Decoder(EvalContract)
_verdict_decoder: Final = msgspec.json.Decoder(Verdict)


def draw_seeds(n: int) -> tuple[int, ...]:
    """`n` fresh private seeds (distinct, so no two pairs repeat one)."""
    seeds: list[int] = []
    while len(seeds) < n:
        s = secrets.randbelow(SEED_BOUND)
        if s not in seeds:
            seeds.append(s)
    return tuple(seeds)


# --- base commit and seed -----------------------------------------------------------------------------------


def changed_paths(
    repo: R.KernelRepo, base_tree: str, tree: str, patterns: tuple[str, ...]
) -> tuple[str, ...]:
    """The protected paths (`patterns`, matched as on the node: kernel.node.wrapper.is_protected) that differ between
    the base tree and the candidate's, both held in the kernel's repository of the workspace."""
    out = repo.git(
        "diff-tree", "-r", "-z", "--name-only", "--no-renames", "--end-of-options", base_tree, tree
    )
    if out.returncode != 0:
        raise R.RepoError(f"cannot compare {tree[:12]} with the base {base_tree[:12]}: {R.first_line(out)}")
    names = [n.decode("utf-8", "surrogateescape") for n in out.stdout.split(b"\0") if n]
    return tuple(n for n in names if is_protected(list(patterns), n))


# The paths left out of a side that a verdict lists (removed shadows, what the scorer did not see); all are counted.
PATHS_KEPT: Final = 50


@dataclass(frozen=True, slots=True)
class Removed:
    """What the node removes from the sides' trees because it could shadow a protected file (the first
    PATHS_KEPT, and how many in all)."""

    paths: tuple[SidePath, ...] = ()
    count: int = 0


_removed_decoder: Final = msgspec.json.Decoder(Removed)


def _names(repo: R.KernelRepo, tree: str) -> list[str]:
    out = repo.git("ls-tree", "-r", "-z", "--name-only", "--full-tree", "--end-of-options", tree)
    if out.returncode != 0:
        raise R.RepoError(f"cannot list the tree {tree[:12]}: {R.first_line(out)}")
    return [n.decode("utf-8", "surrogateescape") for n in out.stdout.split(b"\0") if n]


def shadows_removed(repo: R.KernelRepo, base_tree: str, tree: str, patterns: tuple[str, ...]) -> Removed:
    """The paths of each side (the base's tree, the candidate's) that the node removes when it materialises
    them with protected `patterns` (kernel.node.wrapper.shadowing, the function the node uses, on the same
    listings of the kernel's repository), so the wake names exactly what the node removed."""
    base = _names(repo, base_tree)
    sides: tuple[tuple[Literal["base", "candidate"], list[str]], ...] = (
        ("base", base),
        ("candidate", base if tree == base_tree else _names(repo, tree)),
    )
    found = [
        SidePath(side=side, path=_shown(p), why=why)
        for side, names in sides
        for p, why in shadowing(list(patterns), base, names)
    ]
    return Removed(tuple(found[:PATHS_KEPT]), len(found))


def _shown(path: str) -> str:
    """A tree path as text a JSON wake can carry (undecodable bytes escaped)."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def base_of(store: Store, workspace: str) -> tuple[str, str] | None:
    """(commit, kernel tree) of the recorded base; None when there is none or it is not held yet."""
    row = store.eval_base(workspace)
    return None if row is None or row[0] is None or row[1] is None else (row[0], row[1])


def pending_base(store: Store, workspace: str) -> str | None:
    """A base commit recorded but not held yet (its import from the agent's `.git` was refused so far)."""
    row = store.eval_base(workspace)
    return None if row is None or row[0] is None or row[1] is not None else row[0]


def set_pending_base(store: Store, workspace: str, commit: str) -> None:
    """Record HEAD as the base before it could be held (in the caller's transaction; only when none is)."""
    store.set_pending_eval_base(workspace, commit, timestamp())


def base_to_hold(store: Store, workspace: str) -> tuple[tuple[str, str] | None, str | None]:
    """(recorded base or None, the commit to import when it is not held: the recorded one or a pending one;
    None when nothing is recorded) in the caller's transaction."""
    base = base_of(store, workspace)
    return base, base[0] if base is not None else pending_base(store, workspace)


def record_held(store: Store, workspace: str, before: tuple[str, str] | None, got: R.Base) -> None:
    """Record a base just imported (in the caller's transaction), unless the operator moved it meanwhile."""
    now = base_of(store, workspace)
    if now == before and (before is None or before[0] == got.commit):
        set_base(store, workspace, got.commit, got.tree)


def take_base(repo: R.KernelRepo, path: str, rev: str, tmp_dir: str | os.PathLike[str]) -> R.Base | None:
    """Import `rev` of the workspace as a base through the verified path (kernel.io.repo.import_base): held in
    the kernel's repository. R.UntrustedGit (the agent's .git, named), R.RepoError (the kernel's side)."""
    repo.ensure()
    return R.import_base(repo, path, rev, tmp_dir=tmp_dir)


def head_of(path: str) -> str | None:
    """The workspace's HEAD commit id, read without git and without following a link (None when unreadable)."""
    try:
        fd = R.open_dot_git(path)
    except R.UntrustedGit:
        return None
    try:
        return R.read_head(fd, os.path.join(path, ".git"))
    except (R.UntrustedGit, OSError):
        return None
    finally:
        os.close(fd)


def set_base(store: Store, workspace: str, commit: str, tree: str) -> None:
    """Record the base (in the caller's transaction)."""
    store.set_eval_base(workspace, commit, tree, timestamp())


def rebase(store: Store, workspace: str, commit: str, tree: str) -> None:
    """Move the base (in the caller's transaction). Measurements are keyed by the base tree, so a rebase starts
    with nothing reused; the ladder's best (a gain over the old base) starts again at 0, while thresholdout's
    spent budget stays spent (it counts what the private data disclosed, whatever the base)."""
    set_base(store, workspace, commit, tree)
    state = disclosure_state(store, workspace)
    if state.best != 0:
        put_disclosure_state(store, workspace, D.State(Decimal(0), state.spent, state.noisy_threshold))


def contract_of(store: Store, workspace: str) -> EvalContract | None:
    """The contract the operator gave this workspace at enrollment (None: the config's default applies)."""
    blob = store.eval_contract(workspace)
    return None if blob is None else _contract_decoder.decode(blob)


def contracts(store: Store) -> dict[str, EvalContract]:
    """`contract_of` every workspace that has its own, in one query."""
    return {key: _contract_decoder.decode(blob) for key, blob in store.eval_contracts().items()}


def set_contract(store: Store, workspace: str, contract: EvalContract) -> None:
    store.set_eval_contract(workspace, msgspec.json.encode(contract))


def effective_policy(store: Store, workspace: str, defaults: Policy) -> Policy:
    """The config's policy with the workspace's own contract, if it has one."""
    own = contract_of(store, workspace)
    return defaults if own is None else msgspec.structs.replace(defaults, submit=own)


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
    reused_values: tuple[Decimal, ...] | None
    seeds: tuple[int, ...] = ()
    protected_changed: tuple[str, ...] = ()
    removed: Removed = Removed()
    seeds_from_seq: int | None = None  # `reuse`: the submit that measured the base (and drew the seeds)


def plan_of(store: Store, workspace: str, seq: int) -> Plan | None:
    row = store.eval_plan(workspace, seq)
    if row is None:
        return None
    decision: Decision = row[2]  # type: ignore[assignment]  # only put_plan writes it, from a Decision
    return Plan(
        workspace,
        seq,
        decision,
        _contract_decoder.decode(row[3]),
        row[4],
        row[5],
        row[6],
        row[7],
        row[8],
        row[9],
        None if row[10] is None else tuple(Decimal(v) for v in json.loads(row[10])),
        tuple(json.loads(row[11])) if row[11] else (),
        tuple(json.loads(row[12])) if row[12] else (),
        _removed_decoder.decode(row[13]) if row[13] else Removed(),
        row[14],
    )


def put_plan(store: Store, p: Plan) -> None:
    store.put_eval_plan(
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
            None if p.reused_values is None else json.dumps([str(v) for v in p.reused_values]),
            json.dumps(list(p.seeds)),
            json.dumps(list(p.protected_changed)),
            msgspec.json.encode(p.removed).decode(),
            p.seeds_from_seq,
        ),
    )


# --- baselines and verdicts -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """A stored base measurement: its seeds, one value per seed, and the submit (seq) that measured it."""

    seeds: tuple[int, ...]
    values: tuple[Decimal, ...]
    seq: int


def measurement(store: Store, key: str) -> Measurement | None:
    row = store.eval_measurement(key)
    if row is None:
        return None
    return Measurement(tuple(json.loads(row[0])), tuple(Decimal(v) for v in json.loads(row[1])), row[2])


def disclosure_state(store: Store, workspace: str) -> D.State:
    """The workspace's disclosure state (kernel.core.disclosure), kept across submits and restarts."""
    row = store.eval_disclosure(workspace)
    return D.State() if row is None else D.State(Decimal(row[0]), row[1], row[2])


def put_disclosure_state(store: Store, workspace: str, state: D.State) -> None:
    """Record it (in the caller's transaction: the gather's, which records the verdict it disclosed)."""
    store.put_eval_disclosure(workspace, str(state.best), state.spent, state.noisy_threshold)


def put_measurement(
    store: Store, key: str, seeds: tuple[int, ...], values: tuple[Decimal, ...], workspace: str, seq: int
) -> None:
    store.put_eval_measurement(
        key, json.dumps(list(seeds)), json.dumps([str(v) for v in values]), workspace, seq, timestamp()
    )


def put_verdict(
    store: Store, workspace: str, seq: int, sleep_id: str, verdict: Verdict, report: str, hook: bool
) -> None:
    store.put_eval_verdict(
        workspace,
        seq,
        sleep_id,
        verdict.outcome,
        encode(verdict),
        report,
        timestamp(),
        "pending" if hook else "none",
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
    rows = store.eval_verdicts(workspace=workspace, hook_pending=hook_pending)
    return [StoredVerdict(r[0], r[1], r[2], stored_verdict(r[3]), r[4], r[5]) for r in rows]


def stored_verdict(blob: bytes) -> Verdict:
    """A recorded verdict; one recorded by a kernel before seeds became private carries the seed, which is
    dropped here (it must not reach the hook's payload as a field the protocol no longer has)."""
    try:
        return _verdict_decoder.decode(blob)
    except msgspec.ValidationError:
        raw = msgspec.json.decode(blob)
        if not isinstance(raw, dict) or "seed" not in raw:
            raise
        raw.pop("seed")
        return msgspec.convert(raw, Verdict)


def set_hook_status(store: Store, workspace: str, seq: int, status: str) -> None:
    with store.transaction():
        store.set_eval_hook_status(workspace, seq, status[:500])
