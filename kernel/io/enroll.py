"""Enrollment: making a workspace's channel and recording who it is.

`enroll` checks that the workspace is a directory this kernel may use (a real directory owned by us, a git
repository whose `.git` is a real directory, not tracking `.syscall/`), creates the channel through `safefs`,
installs the tool and the channel's `.gitignore` (`*`, so the agent's `git status` never shows the channel), records the channel's (device, inode, owner) with its
budget and policy, and then writes `kernel.json` and `budget.json` (that of a channel a kernel may serve through
`publish_budget`, never over a newer balance the kernel wrote). Re-enrolling is idempotent: it refreshes the
tool and the kernel-written files and keeps the budget unless new grants are given. An operator's explicit
`enroll` adopts a channel that was replaced (and says so); automatic enrollment at start never does.

Git never reads the agent's `.git` here: whether `.syscall/` is tracked is asked of a kernel-owned copy of the
index (kernel.snapshot.tracked_under), and the submit base is taken through kernel.io.repo's verified import.
Nothing is ever written into `.git`: not by the service, not by this operator's command.
"""

from __future__ import annotations

import glob
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final, Literal

import msgspec

from channel import limits as L
from channel import release, safefs
from channel.messages import (
    BudgetFile,
    EvalContract,
    KernelInfo,
    KernelRef,
    Limits,
    Policy,
    StoreRef,
    VerdictRules,
    encode,
)
from channel.paths import CHANNEL_DIR, ChannelPaths, workspace_key
from kernel.core import budget, ledger
from kernel.core.budget import Balance
from kernel.core.config import Config, score_data_problem, slurm_account_ok
from kernel.core.contract import contract_of, published_limits
from kernel.core.evaluate import EVAL_FLAGS, contract_problem
from kernel.core.records import WorkspaceRow
from kernel.io import chanlock, jobenv, statedir, watch
from kernel.io import repo as R
from kernel.io import submit as S
from kernel.io.budgetorder import BudgetOrder
from kernel.io.install import ToolSource, install
from kernel.io.repo import KernelRepo
from kernel.io.snapshot import SnapshotError, listing_jail, tracked_under
from kernel.io.store import AdminRow, Store, timestamp
from kernel.node.jail import JailPolicy

KERNEL_NAME: Final = "syscall-kernel"


def kernel_ref() -> KernelRef:
    return KernelRef(name=KERNEL_NAME, version=release.VERSION, commit=release.COMMIT)


class EnrollError(Exception):
    """The workspace cannot be enrolled; the message says why and what to do."""


class OwnedElsewhere(EnrollError):
    """The channel's kernel.json names another kernel's store as its owner."""

    def __init__(self, path: str, owner: StoreRef) -> None:
        self.owner = owner
        super().__init__(
            f"{path}: the channel is owned by another kernel's store ({owner.store}, state_dir {owner.state_dir}); "
            "not taking it over. Stop serving it there (`syscall-kernel unenroll` with that kernel's config), or "
            f"run `syscall-kernel enroll --take-over {path}` to move it to this kernel"
        )


class HeldElsewhere(EnrollError):
    """Another process (another kernel, or the agent) holds the channel directory's lock (kernel.io.chanlock)."""


# The channel's lock (kernel.io.chanlock), taken for a workspace key before anything is written to its channel
# (the service holds it; an operator's `enroll` only probes it): why not (another process holds it), or None.
Claim = Callable[[str, safefs.Channel], str | None]


def claim_channel(claim: Claim | None, key: str, ch: safefs.Channel, path: str) -> None:
    """Take (or probe) `ch`'s lock for `key` through `claim`; HeldElsewhere when another process holds it. No
    `claim`: nothing to take."""
    if claim is not None:
        held_elsewhere = claim(key, ch)
        if held_elsewhere is not None:
            raise HeldElsewhere(f"{path}: {held_elsewhere}")


def _make_channel(path: str, resolved: str) -> safefs.Channel:
    """The channel of a workspace being enrolled, opened (and made where missing); EnrollError saying what is in
    the way."""
    try:
        return safefs.open_channel(resolved, create=True)
    except safefs.ChannelMoved as exc:
        raise EnrollError(f"{path}: the channel cannot be made: {exc}") from None
    except safefs.Refused as exc:
        raise EnrollError(f"{path}: {CHANNEL_DIR}/{exc}; remove it and enroll again") from None


@dataclass(frozen=True, slots=True)
class Grant:
    """Budgets an operator sets at enrollment; None keeps the current value (or the config default if new)."""

    launches: int | None = None
    sleeps: int | None = None
    gpu_hours: float | None = None


@dataclass(frozen=True, slots=True)
class Enrolled:
    row: WorkspaceRow
    created: bool
    tool_note: str | None
    adopted_new_channel: bool
    # Why the submit base could not be held under its kernel ref (None: held, or no base yet).
    base_problem: str | None = None
    # The store the channel was taken from (`enroll --take-over`).
    taken_from: StoreRef | None = None
    # The workspace's own Slurm account (None: the config's `[slurm] account`).
    slurm_account: str | None = None
    # How budget.json shows the balance enrolled (`publish_budget`).
    budget_shown: Published | None = None


def tracked_channel_files(workspace: str, jail: JailPolicy | None = None) -> list[str]:
    """Paths under `.syscall/` that the workspace's git index tracks (should be none); git lists them in `jail`."""
    try:
        return tracked_under(workspace, CHANNEL_DIR, jail)
    except SnapshotError as exc:
        raise EnrollError(f"{workspace}: {exc}") from None
    except R.RepoError as exc:
        raise EnrollError(str(exc)) from None


def check_workspace(path: str, *, resolved_already: bool = False, jail: JailPolicy | None = None) -> str:
    """The resolved workspace path, or EnrollError saying why this kernel may not use it (`resolved_already`:
    `path` is already resolved, e.g. by `expand_globs`)."""
    if not path:
        raise EnrollError("no workspace path given")
    resolved = path if resolved_already else os.path.realpath(path)
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        raise EnrollError(f"{path}: no such directory") from None
    except OSError as exc:
        raise EnrollError(f"{path}: cannot be examined: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise EnrollError(f"{path}: not a directory")
    if st.st_uid != os.geteuid():
        raise EnrollError(
            f"{path}: owned by uid {st.st_uid}, but this kernel runs as uid {os.geteuid()}; run one kernel per "
            "user, as the user who owns the workspaces"
        )
    if not os.access(resolved, os.W_OK | os.X_OK):
        raise EnrollError(f"{path}: this kernel cannot write into it")
    try:
        git = os.lstat(os.path.join(resolved, ".git"))
    except FileNotFoundError:
        raise EnrollError(f"{path}: not a git repository (run `git init` there first)") from None
    if not stat.S_ISDIR(git.st_mode):
        raise EnrollError(
            f"{path}: .git is a {'symlink' if stat.S_ISLNK(git.st_mode) else 'file'}, not a directory; the "
            "kernel snapshots only repositories whose .git is a real directory (no worktrees or links)"
        )
    tracked = tracked_channel_files(resolved, jail)
    if tracked:
        shown = ", ".join(tracked[:3]) + (" ..." if len(tracked) > 3 else "")
        raise EnrollError(
            f"{path}: the repository tracks {len(tracked)} file(s) under {CHANNEL_DIR}/ ({shown}); the channel "
            f"must never be committed. Remove it from the index (`git rm -r --cached {CHANNEL_DIR}`), commit, "
            "and enroll again"
        )
    return resolved


def _balance_for(cfg: Config, existing: WorkspaceRow | None, grant: Grant) -> Balance:
    base = (
        existing.balance
        if existing is not None
        else ledger.opening(
            cfg.defaults.launches, cfg.defaults.sleeps, budget.gpu_seconds(cfg.defaults.gpu_hours)
        )
    )
    return ledger.granted(
        base,
        launches=grant.launches,
        sleeps=grant.sleeps,
        gpu_s=None if grant.gpu_hours is None else budget.gpu_seconds(grant.gpu_hours),
    )


class _OwnerOnly(msgspec.Struct):
    """kernel.json read for its `owner` alone (the other fields are ignored, not checked)."""

    owner: StoreRef | None = None


_owner_decoder: Final = msgspec.json.Decoder(_OwnerOnly)


def owner_of(ch: safefs.Channel) -> StoreRef | None:
    """The store kernel.json names as the channel's owner; None when it names none or cannot be read (a channel
    from before owners were recorded, or one the agent damaged: the next write restores it)."""
    try:
        return _owner_decoder.decode(
            safefs.read_capped_at(ch.fd, ChannelPaths.KERNEL_JSON, 1024 * 1024)
        ).owner
    except (safefs.Refused, msgspec.DecodeError, msgspec.ValidationError):
        return None


# (dev, ino, size, mtime_ns, ctime_ns) of a channel's kernel.json.
Fingerprint = tuple[int, int, int, int, int]
# A fingerprint is recorded only for a kernel.json unchanged for this long before it was stat'ed (ctime is kept
# by the filesystem with a coarse clock: a few ms).
QUIET_NS: Final = 1_000_000_000


def _fingerprint(st: os.stat_result) -> Fingerprint:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def owner_unchanged(ch: safefs.Channel, seen: Fingerprint | None) -> bool:
    """True when kernel.json is the very file, unchanged, that `owner_fingerprint` saw name this store: one lstat.
    Nobody can set a ctime: a write, a chmod, a rename onto the name (a new inode) all give it a ctime past the
    recorded one, which was over QUIET_NS old when recorded, so any change since makes this False."""
    if seen is None:
        return False
    try:
        st = os.stat(ChannelPaths.KERNEL_JSON, dir_fd=ch.fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and _fingerprint(st) == seen


def owner_fingerprint(ch: safefs.Channel, path: str, *, mine: str) -> Fingerprint | None:
    """`check_owner` (OwnedElsewhere when kernel.json names another store), and the stat of the kernel.json it
    read, taken BEFORE the read: the fingerprint `owner_unchanged` accepts later. None (nothing to record) when
    the file changed within QUIET_NS of that stat or cannot be read: a change after the stat then cannot share
    its ctime, since ctimes only move forward and the recorded one is over QUIET_NS behind the stat."""
    now = time.time_ns()
    try:
        st = os.stat(ChannelPaths.KERNEL_JSON, dir_fd=ch.fd, follow_symlinks=False)
    except OSError:
        st = None
    try:
        data, inode = safefs.read_capped_entry_at(ch.fd, ChannelPaths.KERNEL_JSON, 1024 * 1024)
        found = _owner_decoder.decode(data).owner
    except (safefs.Refused, msgspec.DecodeError, msgspec.ValidationError):
        found, inode = None, None
    if found is not None and found.store != mine:
        raise OwnedElsewhere(path, found)
    if st is None or inode != (st.st_dev, st.st_ino) or st.st_ctime_ns > now - QUIET_NS:
        return None
    return _fingerprint(st)


def check_owner(store: Store, ch: safefs.Channel, path: str, *, mine: str | None = None) -> StoreRef:
    """This store as the channel's owner, or OwnedElsewhere when kernel.json names another store. `mine`: the
    store's id when the caller has read it already."""
    mine = mine or store.store_id()
    if mine is None:
        raise EnrollError(f"{store.path}: the store has no id (open it read-write once)")
    found = owner_of(ch)
    if found is not None and found.store != mine:
        raise OwnedElsewhere(path, found)
    return StoreRef(store=mine, state_dir=str(store.path.parent))


def kernel_json(
    row: WorkspaceRow,
    tool: ToolSource,
    owner: StoreRef | None = None,
    *,
    jail: str,
    limits: Limits | None = None,
    package_index: str | None = None,
    verdicts: VerdictRules | None = None,
) -> bytes:
    """`kernel.json`; `jail` (the config's) decides, with the contract, whether its verdicts are trusted;
    `limits` as `published_limits` makes them from the config, `package_index` as `jobenv.package_index`,
    `verdicts` the config's `[verdicts]`."""
    c = contract_of(row.policy, jail=jail, limits=limits, verdicts=verdicts)
    return encode(
        KernelInfo(
            protocol=L.PROTOCOL_VERSION,
            kernel=kernel_ref(),
            workspace=row.path,
            limits=c.limits,
            policy=c.policy,
            verbs=c.verbs,
            tool_sha256=tool.sha256,
            owner=owner,
            submit_trusted=c.submit_trusted,
            package_index=package_index,
            submit_verdicts=c.submit_verdicts,
        )
    )


def budget_json(balance: Balance, now: str) -> bytes:
    return encode(BudgetFile(protocol=L.PROTOCOL_VERSION, budget=balance.to_message(), updated_at=now))


def enroll(
    store: Store,
    cfg: Config,
    path: str,
    tool: ToolSource,
    grant: Grant = Grant(),
    *,
    explicit: bool = True,
    mounts: list[tuple[str, str]] | None = None,
    contract: EvalContract | None = None,
    take_over: bool = False,
    overrides: Mapping[str, int | bool] | None = None,
    slurm_account: str | None = None,
    hold_base: bool = True,
    checked: str | None = None,
    claim: Claim | None = None,
) -> Enrolled:
    """Enroll (or refresh) one workspace. EnrollError when it is refused.

    The eval contract: `contract` when given (kept for this workspace from then on), else the one given at an
    earlier enrollment, else the config's `[defaults.submit]`. The base commit for submit is recorded as HEAD the
    first time the workspace has one; later enrollments keep it (the operator moves it with `syscall-kernel
    rebase`). Every enrollment makes sure the kernel's own repository holds it (kernel.io.repo; nothing is
    written into the agent's `.git`).

    A channel whose kernel.json names another store as its owner is refused (OwnedElsewhere) unless `take_over`.
    `overrides` (policy fields: max_minutes, max_gpus, max_concurrent_gpus, max_mem_mb, max_cpus,
    max_sleeps_in_flight, network) are kept for this workspace
    on top of the config's defaults, from then on; an unenrolled workspace is enrolled again.
    `slurm_account` (`--account`) is the workspace's own Slurm account from then on ("" drops it: the config's
    `[slurm] account` again); None keeps what it had.
    `hold_base=False` (the service's automatic enrollment) records HEAD's commit id as the pending base (read
    without git, in the enrollment's transaction) and leaves the import to the executor, which holds it after
    the workspace is served (the upgrade SubmitEvaluation.run starts, and before any submit): the base is still HEAD
    as it was at enrollment, and first-time enrollment runs no git process but the tracked-channel check.
    `checked`: what `check_workspace(path)` returned just before (the service runs those checks, one git
    process each, in worker threads, many at once); None runs it here.
    `claim` (the service's channel lock, kernel.io.chanlock) is called before anything is written: a problem it
    returns refuses the enrollment with nothing written (another kernel serves the channel).
    The store's sleep numbering for the workspace starts after every seq the channel already shows (results/,
    wakes/), so `results/<seq>/` written under an earlier store is never overwritten.
    """
    for name, v in (("launches", grant.launches), ("sleeps", grant.sleeps), ("gpu-hours", grant.gpu_hours)):
        if v is not None and v < 0:
            raise EnrollError(f"--{name} must be >= 0, got {v}")
    resolved = check_workspace(path, jail=listing_jail(cfg)) if checked is None else checked
    key = workspace_key(resolved)
    existing = store.workspace(key)
    chosen = contract or S.contract_of(store, key) or cfg.defaults.submit
    admin = store.admin(key)
    own = {**admin.overrides, **(overrides or {})}
    wrong = overrides_problem(cfg.defaults.policy(), own)
    if wrong is not None:
        raise EnrollError(f"{path}: {wrong}")
    if slurm_account and not slurm_account_ok(slurm_account):
        raise EnrollError(
            f"{path}: --account {slurm_account!r} is not a Slurm account name (letters, digits and _ . + -, "
            "at most 64 characters)"
        )
    if chosen is not None:
        problem = contract_problem(chosen) or score_data_problem(chosen, resolved)
        if problem is not None:
            where = f"--{EVAL_FLAGS.get(problem[0], problem[0])}" if contract is not None else problem[0]
            raise EnrollError(f"{path}: the eval contract's {where}: {problem[1]}")
    adopted = False
    with _make_channel(path, resolved) as ch:
        try:
            owner = check_owner(store, ch, resolved)
        except OwnedElsewhere as exc:
            if not take_over:
                raise
            owner = StoreRef(store=store.store_id() or "", state_dir=str(store.path.parent))
            taken_from: StoreRef | None = exc.owner
        else:
            taken_from = None
        claim_channel(claim, key, ch, path)
        if existing is not None and ch.identity.differs_from(existing.identity):
            if not explicit:
                what = (
                    CHANNEL_DIR
                    if not ch.identity.same_directory(existing.identity)
                    else "a subdirectory of it"
                )
                raise EnrollError(
                    f"{path}: {what} is not the directory enrolled before ({ch.identity} != "
                    f"{existing.identity}); not serving it. Check the workspace, then run "
                    f"`syscall-kernel enroll {resolved}` to adopt the new channel"
                )
            adopted = True
        try:
            note = install(ch, tool)
        except safefs.Refused as exc:
            raise EnrollError(f"{path}: cannot install the tool: {exc}") from None
        now = timestamp()
        fstype = watch.fs_type_of(resolved, watch.read_mounts() if mounts is None else mounts)
        row = WorkspaceRow(
            key=key,
            path=resolved,
            identity=ch.identity,
            balance=_balance_for(cfg, existing, grant),
            policy=msgspec.structs.replace(with_overrides(cfg.defaults.policy(), own), submit=chosen),
            tool_sha256=tool.sha256,
            watch=watch.choose_mode(cfg.watch, fstype),
            enrolled_at=existing.enrolled_at if existing is not None else now,
            problem=None,
        )
        floor = seq_floor(ch)
        # budget.json of a channel no kernel serves (a new workspace, an unenrolled one enrolled again, a channel
        # adopted) is written before the row commits: before any kernel knows the row, so before any write of
        # its own. That of a channel a kernel may serve is published after the commit (`publish_budget`: never
        # over a newer balance the kernel wrote).
        unserved = existing is None or admin.unenrolled_at is not None or adopted
        if unserved:
            ch.write_file(None, ChannelPaths.BUDGET_JSON, budget_json(row.balance, now))
        with store.transaction():
            # The balance from the row as it is in this transaction: a charge the running kernel made since
            # `existing` was read is kept (it used to be undone: a sleep charged, or GPU time reserved, twice over).
            row = replace(row, balance=_balance_for(cfg, store.workspace(key), grant))
            store.put_workspace(row)
            store.raise_seq_floor(key, floor)
            if own != admin.overrides or admin.unenrolled_at is not None:
                store.set_admin(key, replace(admin, unenrolled_at=None, overrides=own))
            if contract is not None:
                S.set_contract(store, key, contract)
            if slurm_account is not None:
                store.set_slurm_account(key, slurm_account or None)
            if not hold_base:
                head = S.head_of(resolved)
                if head is not None:
                    S.set_pending_base(store, key, head)
        # The submit base: HEAD the first time, taken through the verified path into the kernel's repository (an
        # older kernel's base, recorded but held only in the agent's repository, is re-imported by its id).
        base_problem = hold_recorded_base(store, cfg, key, resolved) if hold_base else None
        # Side effects after the commit: the channel's kernel-written files.
        write_kernel_files(ch, row, tool, owner, cfg, now, with_budget=False)
        shown = Published("written") if unserved else publish_budget(store, row, ch=ch)
    return Enrolled(
        row=row,
        created=existing is None,
        tool_note=note,
        adopted_new_channel=adopted,
        base_problem=base_problem,
        taken_from=taken_from,
        slurm_account=store.slurm_account(key),
        budget_shown=shown,
    )


@dataclass(frozen=True, slots=True)
class NewFacts:
    """What the store knows that bears on enrolling paths it has no workspace row for, read once (on the store's
    thread) for a whole batch: this store's owner reference, and the admin rows and own eval contracts by key
    (normally none: they are written with a workspace's row)."""

    owner: StoreRef
    admins: Mapping[str, AdminRow]
    contracts: Mapping[str, EvalContract]


def new_facts(store: Store) -> NewFacts:
    mine = store.store_id()
    if mine is None:
        raise EnrollError(f"{store.path}: the store has no id (open it read-write once)")
    return NewFacts(
        owner=StoreRef(store=mine, state_dir=str(store.path.parent)),
        admins=store.admins(),
        contracts=S.contracts(store),
    )


@dataclass(frozen=True, slots=True)
class Prepared:
    """A new workspace's channel, made and filled but not durable yet, and what its rows will record."""

    row: WorkspaceRow
    floor: int
    head: str | None
    admin: AdminRow
    dev: int  # the channel's filesystem, synced before the rows commit


def prepare_new(
    facts: NewFacts,
    cfg: Config,
    path: str,
    tool: ToolSource,
    *,
    mounts: list[tuple[str, str]],
    claim: Claim | None = None,
) -> Prepared:
    """The channel half of the service's automatic enrollment of `path`, which the store has no row for:
    `enroll(explicit=False, hold_base=False)` without touching the store, so many run at once in threads.
    Every channel file is written with `durable=False`; one sync per filesystem (`sync_workspace_fs`) makes a
    batch of them durable, and then `record_new` (on the store's thread) commits their rows. EnrollError when refused. `path`
    comes resolved from `expand_globs`."""
    resolved = check_workspace(path, resolved_already=True, jail=listing_jail(cfg))
    key = workspace_key(resolved)
    admin = facts.admins.get(key, AdminRow())
    own = dict(admin.overrides)
    wrong = overrides_problem(cfg.defaults.policy(), own)
    if wrong is not None:
        raise EnrollError(f"{path}: {wrong}")
    chosen = facts.contracts.get(key) or cfg.defaults.submit
    if chosen is not None:
        problem = contract_problem(chosen) or score_data_problem(chosen, resolved)
        if problem is not None:
            raise EnrollError(f"{path}: the eval contract's {problem[0]}: {problem[1]}")
    with _make_channel(path, resolved) as ch:
        found = owner_of(ch)
        if found is not None and found.store != facts.owner.store:
            raise OwnedElsewhere(resolved, found)
        claim_channel(claim, key, ch, path)
        try:
            install(ch, tool, durable=False)
        except safefs.Refused as exc:
            raise EnrollError(f"{path}: cannot install the tool: {exc}") from None
        now = timestamp()
        row = WorkspaceRow(
            key=key,
            path=resolved,
            identity=ch.identity,
            balance=_balance_for(cfg, None, Grant()),
            policy=msgspec.structs.replace(with_overrides(cfg.defaults.policy(), own), submit=chosen),
            tool_sha256=tool.sha256,
            watch=watch.choose_mode(cfg.watch, watch.fs_type_of(resolved, mounts)),
            enrolled_at=now,
            problem=None,
        )
        floor = seq_floor(ch)
        write_kernel_files(ch, row, tool, facts.owner, cfg, now, durable=False)
        dev = os.fstat(ch.fd).st_dev
    return Prepared(row=row, floor=floor, head=S.head_of(resolved), admin=admin, dev=dev)


def filesystems_of(batch: Iterable[Prepared]) -> dict[int, str]:
    """The filesystems holding a batch of `prepare_new`d channels: device -> one workspace path on it (what
    `sync_workspace_fs` is given before `record_new`)."""
    found: dict[int, str] = {}
    for p in batch:
        found.setdefault(p.dev, p.row.path)
    return found


def record_new(store: Store, batch: list[Prepared]) -> None:
    """Record a batch of `prepare_new`d workspaces: every row in one transaction.

    Invariant: a workspace row committed means its channel files are durable. Each file was renamed into place
    without an fsync of its own; the caller calls this only after `sync_workspace_fs` (syncfs of the filesystem)
    of each of `filesystems_of(batch)` has returned, which returns only once all of them, data and renames, are
    on disk; the sync needs no store, so it runs off the store's thread (a hung filesystem holds no store
    write). A crash before the commit leaves channels without rows, which the next start prepares again (the
    same files, the same lock; no row contradicts them)."""
    with store.transaction():
        for p in batch:
            store.put_workspace(p.row)
            store.raise_seq_floor(p.row.key, p.floor)
            if p.admin.unenrolled_at is not None:
                store.set_admin(p.row.key, replace(p.admin, unenrolled_at=None))
            if p.head is not None:
                S.set_pending_base(store, p.row.key, p.head)


def sync_workspace_fs(path: str) -> None:
    """`safefs.sync_filesystem` of the filesystem holding the workspace `path` (kernel-trusted)."""
    fd = safefs.open_dir(path)
    try:
        safefs.sync_filesystem(fd)
    finally:
        os.close(fd)


def write_kernel_files(
    ch: safefs.Channel,
    row: WorkspaceRow,
    tool: ToolSource,
    owner: StoreRef,
    cfg: Config,
    now: str,
    *,
    durable: bool = True,
    with_budget: bool = True,
) -> None:
    """The channel's kernel-written files of `row`: kernel.json, budget.json (with `with_budget`), jobenv.json."""
    ch.write_file(
        None,
        ChannelPaths.KERNEL_JSON,
        kernel_json(
            row,
            tool,
            owner,
            jail=cfg.jail,
            limits=published_limits(cfg),
            package_index=jobenv.package_index(cfg),
            verdicts=cfg.verdicts,
        ),
        durable=durable,
    )
    if with_budget:
        ch.write_file(None, ChannelPaths.BUDGET_JSON, budget_json(row.balance, now), durable=durable)
    jobenv.write(ch, jobenv.for_workspace(cfg, row.key, row.policy, now), durable=durable)


_wake_seq_decoder: Final = msgspec.json.Decoder(dict[str, object])


def seq_floor(ch: safefs.Channel) -> int:
    """The highest sleep seq the channel shows: `results/<seq>/` names and the `seq` of each wake in `wakes/`
    (what an earlier store, e.g. before an `enroll --take-over`, left there). 0 when none."""
    top = 0
    for sub in (ChannelPaths.RESULTS, ChannelPaths.WAKES):
        try:
            fd = ch.subdir(sub)
        except (safefs.Refused, OSError):
            continue
        try:
            for name in os.listdir(fd):
                if sub == ChannelPaths.RESULTS:
                    if name.isascii() and name.isdigit() and len(name) < 19:
                        top = max(top, int(name))
                    continue
                if not name.endswith(".json"):
                    continue
                try:
                    seq = _wake_seq_decoder.decode(safefs.read_capped_at(fd, name, 1024 * 1024)).get("seq")
                except (safefs.Refused, msgspec.DecodeError, OSError):
                    continue
                if isinstance(seq, int) and not isinstance(seq, bool) and 0 < seq < 2**62:
                    top = max(top, seq)
        finally:
            os.close(fd)
    return top


def hold_recorded_base(store: Store, cfg: Config, key: str, path: str) -> str | None:
    """Make the kernel's repository hold the workspace's recorded base, recording HEAD if there is none yet.
    Returns what went wrong (for the operator), or None. A base refused here (e.g. an object rewritten in place)
    stays recorded by its commit id and is retried before each submit, which is refused while it fails."""
    repo = KernelRepo.at(cfg.run_dir, key)
    with store.transaction():
        base, recorded = S.base_to_hold(store, key)
    if base is not None and R.held(repo, base[1]):
        return None
    rev = recorded or "HEAD"
    try:
        got = S.take_base(repo, path, rev, cfg.paths.tmp)
    except (R.UntrustedGit, R.RepoError, OSError) as exc:
        head = S.head_of(path) if rev == "HEAD" else None
        if head is not None:
            with store.transaction():
                S.set_pending_base(store, key, head)
        return f"the submit base ({head or rev}) is not held: {exc}"
    if got is not None:
        with store.transaction():
            S.record_held(store, key, base, got)
    return None


# The policy fields an operator may set per workspace, with their bounds (as the config's `[defaults]`).
OVERRIDABLE: Final = {
    "max_minutes": (L.MINUTES_MIN, L.MINUTES_CEILING),
    "max_gpus": (0, L.GPUS_CEILING),
    "max_concurrent_gpus": (0, L.GPUS_CEILING * L.ARRAY_MAX),
    "max_mem_mb": (L.MEM_MB_MIN, L.MEM_MB_CEILING),
    "max_cpus": (1, L.CPUS_CEILING),
    "max_sleeps_in_flight": (1, L.SLEEPS_IN_FLIGHT_CEILING),
}


def overrides_problem(defaults: Policy, own: Mapping[str, int | bool]) -> str | None:
    """What is wrong with a workspace's policy overrides (the flag named), or None."""
    for name, v in own.items():
        flag = "--" + name.replace("_", "-")
        if name == "network":
            if not isinstance(v, bool):
                return f"{flag} is true or false"
            continue
        if name not in OVERRIDABLE:
            return f"{name} cannot be set per workspace"
        lo, hi = OVERRIDABLE[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            return f"{flag} must be an integer from {lo} to {hi}, got {v}"
    policy = with_overrides(defaults, own)
    if policy.max_gpus > policy.max_concurrent_gpus:
        return (
            f"--max-gpus {policy.max_gpus} is above the workspace's max_concurrent_gpus "
            f"({policy.max_concurrent_gpus}); no launch could ever run (give --max-concurrent-gpus too)"
        )
    return None


def with_overrides(defaults: Policy, own: Mapping[str, int | bool]) -> Policy:
    return msgspec.structs.replace(defaults, **own) if own else defaults


def policy_for(store: Store, key: str, cfg: Config) -> Policy:
    """A workspace's policy now: the config's defaults, its own overrides, its own eval contract."""
    return S.effective_policy(store, key, with_overrides(cfg.defaults.policy(), store.admin(key).overrides))


def policies_for(store: Store, cfg: Config, keys: Iterable[str]) -> dict[str, Policy]:
    """`policy_for` each of `keys`, from two queries (not two per workspace: a start reads 10,000)."""
    defaults = cfg.defaults.policy()
    admins = store.admins()
    own = S.contracts(store)
    out = {}
    for key in keys:
        admin = admins.get(key)
        policy = with_overrides(defaults, admin.overrides) if admin is not None else defaults
        contract = own.get(key)
        out[key] = policy if contract is None else msgspec.structs.replace(policy, submit=contract)
    return out


def expand_globs(patterns: tuple[str, ...]) -> list[str]:
    """Directories matched by the config's `workspaces` globs, resolved and deduplicated, sorted.

    Each match's parent is resolved once (many matches share it) and the match itself is lstat'ed: a real
    directory resolves to <resolved parent>/<name>; a symlink (or anything else) goes through realpath."""
    found: set[str] = set()
    parents: dict[str, str] = {}
    for pattern in patterns:
        for match in glob.glob(pattern):
            head, name = os.path.split(match)
            try:
                st = os.lstat(match)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and name not in ("", ".", ".."):
                parent = parents.get(head)
                if parent is None:
                    parent = parents[head] = os.path.realpath(head or ".")
                found.add(os.path.join(parent, name))
            elif os.path.isdir(match):
                found.add(os.path.realpath(match))
    return sorted(found)


_budget_file_decoder: Final = msgspec.json.Decoder(BudgetFile)


def write_budget(ch: safefs.Channel, balance: Balance, now: str, *, only_if_changed: bool = False) -> None:
    if only_if_changed:
        try:
            current = _budget_file_decoder.decode(
                safefs.read_capped_at(ch.fd, ChannelPaths.BUDGET_JSON, 65536)
            )
            if current.budget == balance.to_message():
                return
        except (safefs.Refused, msgspec.DecodeError):
            pass
    ch.write_file(None, ChannelPaths.BUDGET_JSON, budget_json(balance, now))


# How long `publish_budget` waits for another short holder of the channel's lock (another operator's command).
LOCK_WAIT_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class Published:
    """How `budget.json` shows a balance the store now holds. `written`: rewritten by this process, now.
    `kernel`: this store's running kernel (pid `kernel`) rewrites it at its next poll tick, while it serves the
    channel. `not_written`: neither, and `why`; a kernel rewrites it from the store when it next serves the channel
    (its next start, or its look at the channel once the problem is gone)."""

    how: Literal["written", "kernel", "not_written"]
    kernel: int | None = None
    why: str | None = None


def publish_budget(
    store: Store, row: WorkspaceRow, *, ch: safefs.Channel | None = None, wait_s: float = LOCK_WAIT_S
) -> Published:
    """After a commit that changed `row`'s balance in this process (not the kernel's: the operator's `budget` or
    `enroll`): bring `budget.json` to the store's balance, without ever putting an older balance over a newer one
    (kernel.io.budgetorder). `ch`: the channel, open already and its owner checked (else it is opened here).

    Invariant: budget.json is written only by the process holding the channel's lock (kernel.io.chanlock), from a
    balance read while it holds it. A kernel holds the lock as long as it serves the channel and orders its own
    writes (BudgetOrder); this process holds it only across one read of the balance and one write, so its write
    can neither interleave with a kernel's writes nor carry a balance older than the one any earlier holder wrote
    (the store's balance only moves forward, and it is read after the lock is taken, so after the last holder let
    go). Hence:
    - a kernel runs on this store (its state dir lock): nothing is written here; the kernel notices the commit at
      its next poll tick and rewrites budget.json in its own order. Taking the lock here would take the channel
      away from it for a rescan.
    - else the lock is taken (waiting up to `wait_s` for another operator's command), the balance read and written.
      A kernel starting meanwhile finds the lock held, and serves the channel from its next rescan on.
    - the lock is held by another process past `wait_s`: if it is this store's kernel (started since the check), it
      read the balance after the commit, and writes it; else another store's kernel or the agent holds the
      channel: not ours to write.
    On a filesystem without flock nothing keeps a kernel starting at this very moment off the channel; then the
    write here may land after that kernel's first charge, and budget.json shows the older balance until its next
    write."""
    kernel = statedir.holder(store.path.parent)
    if kernel is not None:
        return Published("kernel", kernel=kernel)
    try:
        if ch is not None:
            _write_budget_held(store, ch, row.key, wait_s)
        else:
            with safefs.open_channel(row.path, row.identity) as opened:
                check_owner(store, opened, row.path)
                _write_budget_held(store, opened, row.key, wait_s)
    except chanlock.HeldElsewhere as exc:
        kernel = statedir.holder(store.path.parent)
        if kernel is not None and kernel == exc.pid:
            return Published("kernel", kernel=kernel)
        return Published(
            "not_written",
            why=f"another process ({exc}) holds the channel's lock: another kernel serves it, or the agent holds it",
        )
    except OwnedElsewhere as exc:
        return Published("not_written", why=str(exc))
    except safefs.ChannelMoved as exc:
        return Published("not_written", why=f"the channel is not the one enrolled: {exc}")
    except (safefs.Refused, OSError) as exc:
        return Published("not_written", why=f"{type(exc).__name__}: {exc}")
    return Published("written")


def _write_budget_held(store: Store, ch: safefs.Channel, key: str, wait_s: float) -> None:
    with chanlock.held_briefly(ch, wait_s=wait_s):
        current = store.workspace(key)
        assert current is not None  # rows are never deleted (unenrolled ones stay)
        write_budget(ch, current.balance, timestamp())


def rewrite_kernel_files(
    ch: safefs.Channel,
    row: WorkspaceRow,
    tool: ToolSource,
    owner: StoreRef,
    *,
    jail: str,
    cfg: Config | None = None,
    order: BudgetOrder | None = None,
    stamp: int = 0,
) -> str | None:
    """Channel I/O only (no store access): reinstall the tool if it changed, and rewrite `kernel.json`,
    `budget.json` (from `row.balance`; with `order`, unless a write of a balance read after `stamp` ran) and
    with `cfg` `jobenv.json` where they differ from `row`. The tool note."""
    note = install(ch, tool)
    wanted = kernel_json(
        row,
        tool,
        owner,
        jail=jail,
        limits=published_limits(cfg),
        package_index=jobenv.package_index(cfg),
        verdicts=None if cfg is None else cfg.verdicts,
    )
    try:
        current: bytes | None = safefs.read_capped_at(ch.fd, ChannelPaths.KERNEL_JSON, 1024 * 1024)
    except safefs.Refused:
        current = None
    if current != wanted:
        ch.write_file(None, ChannelPaths.KERNEL_JSON, wanted)
    now = timestamp()
    if order is None:
        write_budget(ch, row.balance, now, only_if_changed=True)
    else:
        order.write(row.key, stamp, row.balance, lambda b: write_budget(ch, b, now, only_if_changed=True))
    if cfg is not None:
        jobenv.write(ch, jobenv.for_workspace(cfg, row.key, row.policy, timestamp()))
    return note
