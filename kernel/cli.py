"""`syscall-kernel`: serve, enroll, rebase, status, demo.

Exit codes: 0 ok; 1 the operation was refused or failed (the message says why); 2 bad invocation or config.
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
import json
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

import anyio
import msgspec

from channel import limits as L
from channel import release, safefs
from channel.messages import EvalContract, Verdict
from kernel.core.budget import GPU_SECONDS_PER_HOUR, Balance
from kernel.core.config import Config, ConfigError, load, parse
from kernel.core.evaluate import (
    EVAL_FLAGS,
    SELF_REPORTED_WARNING,
    contract_problem,
    contract_warnings,
    disclosure_warning,
    is_trusted,
)
from kernel.core.records import SleepRow, WorkspaceRow
from kernel.io import log, retention, statedir, stepguard
from kernel.io import submit as S
from kernel.io.repo import KernelRepo, RepoError, UntrustedGit, base_ref
from kernel.io.store import Store, StoreError, StoreNewer

if TYPE_CHECKING:
    from kernel.io.enroll import Published

EXAMPLES = """examples:
  syscall-kernel serve --config /etc/syscall-kernel/config.toml
  syscall-kernel enroll ~/agents/run-17 --launches 40 --sleeps 20 --gpu-hours 12.5
  syscall-kernel enroll ~/agents/run-17 --eval-command "python eval.py" --metric score --min-delta 0.01
  syscall-kernel rebase ~/agents/run-17 HEAD
  syscall-kernel status --json
"""


class TaskStatus(msgspec.Struct, frozen=True):
    launch: str
    task: int
    state: str
    job_id: str | None


class SleepStatus(msgspec.Struct, frozen=True):
    id: str
    seq: int
    state: str
    created_at: str
    tasks: tuple[TaskStatus, ...]


class WorkspaceStatus(msgspec.Struct, frozen=True):
    key: str
    path: str
    watch: str
    problem: str | None
    budget: dict[str, float | int]
    # The newest sleep not ended (woken or rejected), if any.
    sleep: SleepStatus | None
    # "none" (no eval contract), "trusted" or "self-reported" (kernel.core.evaluate.is_trusted)
    submit: str = "none"
    # When the operator paused it (`syscall-kernel pause`), else None.
    paused_at: str | None = None
    # Disk its evidence uses: bytes under its run directories and under its channel's results/ (retention
    # prunes both); `disk_complete` false when a tree was too big to walk whole (then at least these).
    run_bytes: int = 0
    result_bytes: int = 0
    disk_complete: bool = True
    pruned_sleeps: int = 0
    # Every sleep in flight (not yet gathered), oldest first (PROTOCOL.md 6.1: up to max_sleeps_in_flight).
    in_flight: tuple[SleepStatus, ...] = ()


class KernelStatus(msgspec.Struct, frozen=True):
    state_dir: str
    # The pid of the kernel holding the state dir's lock (0: held, pid unreadable); None: no kernel is running.
    kernel_pid: int | None
    # The running kernel's latest status line ("degraded (...)" first when it cannot do all of its work).
    kernel_status: str | None
    workspaces: tuple[WorkspaceStatus, ...]
    live_sleeps: int
    live_jobs: int
    requests: int
    # Set while the store has an older schema than this kernel's (Store.pending_note): read from a migrated copy.
    migration_pending: str | None = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="syscall-kernel",
        description="The agent-facing job kernel: watches enrolled workspaces' channels and answers them.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=release.describe("%(prog)s"))
    sub = p.add_subparsers(dest="command", required=True)

    def config_opt(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--config",
            metavar="FILE",
            help="TOML config (default: $SYSCALL_KERNEL_CONFIG, /etc/syscall-kernel/<user>.toml, /etc/syscall-kernel/config.toml)",
        )

    s = sub.add_parser("serve", help="run the kernel (as a systemd Type=notify service or in a terminal)")
    config_opt(s)
    e = sub.add_parser("enroll", help="enroll a workspace (or refresh it and set its budget)")
    e.add_argument("workspace", help="the workspace directory (a git repository)")
    e.add_argument("--launches", type=int, metavar="N", help="launches left in the budget")
    e.add_argument("--sleeps", type=int, metavar="N", help="sleeps left in the budget")
    e.add_argument("--gpu-hours", type=float, metavar="X", help="GPU-hours left in the budget")
    pol = e.add_argument_group(
        "policy (this workspace's own, kept from then on; default: the config's [defaults])"
    )
    pol.add_argument("--max-minutes", type=int, metavar="M", help="walltime ceiling per launch")
    pol.add_argument("--max-gpus", type=int, metavar="G", help="GPUs per task")
    pol.add_argument("--max-concurrent-gpus", type=int, metavar="G", help="GPUs across running tasks")
    pol.add_argument(
        "--max-mem-mb", type=int, metavar="MB", help="memory a launch may ask for per task (launch --mem)"
    )
    pol.add_argument(
        "--max-cpus", type=int, metavar="N", help="CPUs a launch may ask for per task (launch --cpus)"
    )
    pol.add_argument(
        "--max-sleeps-in-flight",
        type=int,
        metavar="N",
        help="sleeps the workspace may have in flight at once",
    )
    pol.add_argument("--network", action=argparse.BooleanOptionalAction, help="jobs get the network (or not)")
    pol.add_argument(
        "--account",
        metavar="NAME",
        help="Slurm account of this workspace's jobs instead of the config's [slurm] account ('' drops it)",
    )
    e.add_argument(
        "--take-over",
        action="store_true",
        help="enroll a channel that another kernel's store owns (kernel.json `owner`); that kernel stops serving it",
    )
    ev = e.add_argument_group(
        "eval contract (submit)",
        "what `submit` runs on the base and the candidate; all or none of --eval-command/--metric. Without them "
        "the workspace keeps its contract, else gets [defaults.submit]",
    )
    ev.add_argument("--eval-command", metavar="CMD", help="run as `sh -c` in the jail, in the evaluated tree")
    ev.add_argument(
        "--metric", metavar="NAME", help='the key of the JSON line the eval prints: {"NAME": 0.91}'
    )
    ev.add_argument("--direction", choices=("higher", "lower"), default="higher", help="which is better")
    ev.add_argument("--min-delta", type=float, metavar="X", help="inclusive minimum absolute improvement")
    ev.add_argument("--min-relative", type=float, metavar="Y", help="inclusive minimum improvement / |base|")
    ev.add_argument(
        "--eval-minutes", type=int, metavar="M", default=L.MINUTES_DEFAULT, help="walltime per side"
    )
    ev.add_argument("--eval-gpus", type=int, metavar="G", default=0, help="GPUs per side")
    ev.add_argument("--no-seed", action="store_true", help="pass no EVAL_SEED to the eval")
    ev.add_argument(
        "--score-command",
        metavar="CMD",
        help="the operator's scorer: run after --eval-command in its own jail (the side's tree read-only at "
        "$EVAL_TREE, --score-data read-only at $SCORE_DATA, cwd $SCORER); only its stdout carries the metric",
    )
    ev.add_argument(
        "--score-data", metavar="DIR", help="private data for the scorer, outside every workspace (read-only)"
    )
    ev.add_argument(
        "--score-from",
        choices=("operator", "base"),
        default="operator",
        help="where the scorer's files come from: outside every workspace, or the base commit's tree",
    )
    ev.add_argument(
        "--protected",
        action="append",
        default=[],
        metavar="GLOB",
        help="a path pattern taken from the base commit on both sides (repeatable; `**` spans directories)",
    )
    ev.add_argument(
        "--repeats", type=int, metavar="N", default=1, help="paired runs per submit, each with its own seed"
    )
    ev.add_argument(
        "--confidence", type=float, metavar="C", default=0.95, help="of the one-sided test on >= 3 pairs"
    )
    ev.add_argument(
        "--test", choices=("sign", "bootstrap"), default="sign", help="the one-sided test on >= 3 pairs"
    )
    config_opt(e)
    rb = sub.add_parser("rebase", help="move a workspace's submit base to a commit (default: its HEAD)")
    rb.add_argument("workspace", help="an enrolled workspace directory")
    rb.add_argument("commit", nargs="?", default="HEAD", help="a revision of the workspace's repository")
    config_opt(rb)
    st = sub.add_parser("status", help="workspaces, budgets, sleeps and jobs in flight (read from the store)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.add_argument(
        "--state-dir",
        metavar="DIR",
        help="read this state dir, with the config's other keys at their defaults (for when the config file "
        "does not load: a running kernel keeps the config it loaded)",
    )
    config_opt(st)
    ck = sub.add_parser(
        "check", help="check the config, directories, lock, globs, jail and Slurm names; change nothing"
    )
    ck.add_argument("--json", action="store_true", help="one JSON object per finding")
    config_opt(ck)
    u = sub.add_parser("unenroll", help="stop serving a workspace and remove its channel (records are kept)")
    u.add_argument("workspace", help="an enrolled workspace directory (or its key)")
    u.add_argument(
        "--force",
        action="store_true",
        help="even with a sleep in flight: the kernel cancels its jobs and ends the sleep (recorded, its wake kept "
        "in the store, never written)",
    )
    config_opt(u)
    for verb, what in (
        ("pause", "stop answering a workspace (requests wait; jobs in flight go on)"),
        ("resume", "answer a paused workspace again"),
    ):
        pr = sub.add_parser(verb, help=what)
        pr.add_argument("workspace", help="an enrolled workspace directory (or its key)")
        config_opt(pr)
    bu = sub.add_parser("budget", help="add to or set a workspace's budget (recorded: history --budget)")
    bu.add_argument("workspace", help="an enrolled workspace directory (or its key)")
    for kind, typ in (("launches", int), ("sleeps", int), ("gpu-hours", float)):
        bu.add_argument(f"--add-{kind}", type=typ, metavar="N", help=f"add N {kind} (negative: take away)")
        bu.add_argument(f"--set-{kind}", type=typ, metavar="N", help=f"set the {kind} left to N")
    config_opt(bu)
    hi = sub.add_parser(
        "history",
        help="what happened: each workspace's sleeps (newest first, with their tasks' states) and requests; "
        "--budget: the budget changes with who and when; --verdicts: every submit's exact verdict",
    )
    hi.add_argument("workspace", nargs="?", help="only this workspace (an enrolled or unenrolled one)")
    shown = hi.add_mutually_exclusive_group()
    shown.add_argument("--budget", action="store_true", help="the budget changes instead of the sleeps")
    shown.add_argument(
        "--verdicts",
        action="store_true",
        help="every submit's verdict with its exact values, whatever [verdicts] disclosure showed the agent",
    )
    hi.add_argument(
        "--limit", type=int, metavar="N", default=20, help="sleeps per workspace, newest first (default 20)"
    )
    hi.add_argument("--json", action="store_true", help="one JSON object per line")
    config_opt(hi)
    d = sub.add_parser("demo", help="run the kernel's main job on the embedded local backend")
    d.add_argument("--keep", action="store_true", help="keep the demo's temporary directory")
    for verb, (_, what) in SHIPPED.items():
        sub.add_parser(verb, help=f"print {what} shipped with this version (docs/operator.md)")
    return p


# The deployment files shipped inside the package (kernel/share/, which links to deploy/ in the source tree:
# one copy), printed by `syscall-kernel <verb>`: verb -> (file name, what it is).
SHIPPED: Final = {
    "unit": (
        "syscall-kernel@.service",
        "the systemd unit template (install as /etc/systemd/system/syscall-kernel@.service)",
    ),
    "example-config": (
        "config.example.toml",
        "the example config (install as /etc/syscall-kernel/<user>.toml)",
    ),
    "dashboard": (
        "grafana-dashboard.json",
        "the Grafana dashboard over the kernel's metrics (import it in Grafana)",
    ),
}


def shipped(verb: str) -> bytes:
    """The bytes of a shipped deployment file (`SHIPPED`)."""
    name, _ = SHIPPED[verb]
    return (importlib.resources.files("kernel") / "share" / name).read_bytes()


def cmd_shipped(args: argparse.Namespace) -> int:
    sys.stdout.buffer.write(shipped(args.command))
    sys.stdout.buffer.flush()
    return 0


def _config(path: str | None) -> Config:
    return load(path)


def cmd_serve(args: argparse.Namespace) -> int:
    from kernel.service.loop import serve

    cfg = _config(args.config)
    if os.geteuid() == 0 and not cfg.allow_root:
        print(
            "syscall-kernel serve: refusing to run as root: jobs, channels and the state would all be root's. Run "
            "one kernel per user who owns the workspaces (the systemd unit `syscall-kernel unit` prints), or set "
            "allow_root = true in the config if you really mean it",
            file=sys.stderr,
        )
        return 2
    log.setup(log_format=cfg.log_format)
    if os.environ.get(stepguard.ENV) == "1":
        stepguard.install()  # a debugging aid: every filesystem call of a store step fails, and is logged
        log.event("store_guard_installed", env=stepguard.ENV)
    try:
        created = statedir.prepare(cfg.state_dir)
        lock = statedir.StateLock.acquire(cfg.state_dir)
    except statedir.StateDirError as exc:
        log.event("state_dir_refused", logging.ERROR, state_dir=cfg.state_dir, problem=str(exc))
        print(f"syscall-kernel serve: {exc}", file=sys.stderr)
        return 2
    if created:
        log.event("state_dir_created", state_dir=cfg.state_dir)
    log.event(
        "starting",
        config=cfg.source,
        state_dir=cfg.state_dir,
        run_dir=cfg.run_dir,
        backend=cfg.backend,
        jail=cfg.jail,
        watch=cfg.watch,
        pid=os.getpid(),
    )
    if cfg.backend == "local" and cfg.jail == "bwrap":
        # Jobs run here, in bwrap: a host (or a unit) where it cannot jail them would fail every task after ready.
        from kernel.service.check import bwrap_problem

        problem = bwrap_problem()
        if problem is not None:
            log.event("jail_unusable", logging.ERROR, jail=cfg.jail, problem=problem)
            print(f"syscall-kernel serve: the configured jail cannot run jobs: {problem}", file=sys.stderr)
            lock.release()
            return 2
    try:
        anyio.run(functools.partial(serve, cfg, publish=lock.publish))
    except StoreNewer as exc:
        # a rollback over a newer release's store: not a crash, and no restart will change it
        log.event("store_refused", logging.ERROR, store=str(cfg.paths.store), problem=str(exc))
        print(f"syscall-kernel serve: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # Through the logger (journald priority crit), not a bare traceback on stderr; nonzero for Restart=.
        log.crashed(exc)
        return 1
    finally:
        lock.release()
    return 0


def _not_served_elsewhere(state_dir: str) -> Callable[[str, safefs.Channel], str | None]:
    """`enroll`'s check that no other kernel serves the channel (its lock, kernel.io.chanlock): kernel.json's
    `owner` may have been removed by the agent. `--take-over` skips it (the old kernel lets go at its rescan)."""
    from kernel.io import chanlock

    own = statedir.holder(state_dir)

    def claim(key: str, ch: safefs.Channel) -> str | None:
        why = chanlock.probe(ch, own)
        return None if why is None else f"{why}; stop it there, or run `syscall-kernel enroll --take-over`"

    return claim


def cmd_enroll(args: argparse.Namespace) -> int:
    from kernel.io.enroll import EnrollError, Grant, enroll
    from kernel.io.install import ToolMissing, ToolSource

    cfg = _config(args.config)
    for name in ("launches", "sleeps", "gpu_hours"):
        v = getattr(args, name)
        if v is not None and (v < 0 or v != v):
            print(f"syscall-kernel enroll: --{name.replace('_', '-')} must be >= 0, got {v}", file=sys.stderr)
            return 2
    try:
        tool = ToolSource.bundled()
        statedir.prepare(cfg.state_dir)
        store = _writable_store(cfg)
    except (ToolMissing, StoreError, OSError, statedir.StateDirError) as exc:
        print(f"syscall-kernel enroll: {exc}", file=sys.stderr)
        return 1
    contract = _contract(args)
    if isinstance(contract, str):
        print(f"syscall-kernel enroll: {contract}", file=sys.stderr)
        store.close()
        return 2
    try:
        done = enroll(
            store,
            cfg,
            args.workspace,
            tool,
            Grant(args.launches, args.sleeps, args.gpu_hours),
            contract=contract,
            take_over=args.take_over,
            overrides={
                k: v
                for k in (
                    "max_minutes",
                    "max_gpus",
                    "max_concurrent_gpus",
                    "max_mem_mb",
                    "max_cpus",
                    "max_sleeps_in_flight",
                    "network",
                )
                if (v := getattr(args, k)) is not None
            },
            slurm_account=args.account,
            claim=None if args.take_over else _not_served_elsewhere(cfg.state_dir),
        )
    except EnrollError as exc:
        print(f"syscall-kernel enroll: refused: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    row = done.row
    b = row.balance.to_message()
    verb = "enrolled" if done.created else "refreshed"
    print(f"{verb} {row.path} as {row.key} (watch: {row.watch})")
    print(f"  budget: {b.launches} launches, {b.sleeps} sleeps, {b.gpu_hours:g} GPU-hours")
    if done.budget_shown is not None and done.budget_shown.how != "written":
        print(_budget_shown(done.budget_shown, cfg))
    print(
        f"  channel: {row.path}/.syscall (device {row.identity.dev}, inode {row.identity.ino}, uid {row.identity.uid})"
    )
    if done.taken_from is not None:
        print(
            f"  taken over from store {done.taken_from.store} (state_dir {done.taken_from.state_dir}); the kernel "
            "there stops answering it at its next rescan"
        )
    if done.slurm_account is not None or cfg.slurm.account is not None:
        own = "its own" if done.slurm_account is not None else "the config's [slurm] account"
        print(f"  slurm account: {done.slurm_account or cfg.slurm.account} ({own})")
    if done.adopted_new_channel:
        print("  note: the channel had been replaced since the last enrollment; the new one is now recorded")
    if done.tool_note is not None:
        print("  the tool was (re)installed; .syscall/tool-news.md says what is new")
    if done.base_problem is not None:
        print(f"  warning: {done.base_problem}; move the base with `syscall-kernel rebase`")
    c = row.policy.submit
    print(
        f"  submit: {'not available (no eval contract)' if c is None else f'{c.command!r}, metric {c.metric!r} ({c.direction} is better)'}"
    )
    if c is not None and not is_trusted(c, cfg.jail):
        print(f"  warning: {SELF_REPORTED_WARNING}")
    if c is not None:
        hidden = disclosure_warning(c, cfg.verdicts)
        for w in [*contract_warnings(c), *([hidden] if hidden else [])]:
            print(f"  warning: {w}")
    return 0


def _contract(args: argparse.Namespace) -> EvalContract | str | None:
    """The --eval-* flags as a contract, None when absent, or what is wrong with them."""
    if args.eval_command is None and args.metric is None:
        given = [
            f
            for f, v in (
                ("--min-delta", args.min_delta),
                ("--min-relative", args.min_relative),
                ("--no-seed", args.no_seed or None),
                ("--score-command", args.score_command),
                ("--score-data", args.score_data),
                ("--protected", args.protected or None),
            )
            if v is not None
        ]
        if given:
            return f"{', '.join(given)} need --eval-command and --metric"
        return None
    if args.eval_command is None or args.metric is None:
        return "--eval-command and --metric go together"
    contract = EvalContract(
        command=args.eval_command,
        metric=args.metric,
        direction=args.direction,
        min_delta=args.min_delta,
        min_relative=args.min_relative,
        eval_minutes=args.eval_minutes,
        gpus=args.eval_gpus,
        seed=not args.no_seed,
        score=args.score_command,
        score_data=args.score_data,
        score_from=args.score_from,
        protected=tuple(args.protected),
        repeats=args.repeats,
        confidence=args.confidence,
        test=args.test,
    )
    problem = contract_problem(contract)
    if problem is None:
        return contract
    return f"--{EVAL_FLAGS.get(problem[0], problem[0])}: {problem[1]}"


def cmd_rebase(args: argparse.Namespace) -> int:

    cfg = _config(args.config)
    try:
        statedir.prepare(cfg.state_dir, create=False)
        store = _writable_store(cfg)
    except (StoreError, OSError, statedir.StateDirError) as exc:
        print(f"syscall-kernel rebase: {exc}", file=sys.stderr)
        return 1
    try:
        ws = store.workspace_by_path(os.path.realpath(args.workspace))
        if ws is None:
            print(f"syscall-kernel rebase: {args.workspace} is not enrolled", file=sys.stderr)
            return 1
        repo = KernelRepo.at(cfg.run_dir, ws.key)
        try:
            # Taken through the verified path and held in the kernel's repository before it is recorded.
            found = S.take_base(repo, ws.path, args.commit, cfg.paths.tmp)
        except (UntrustedGit, RepoError, OSError) as exc:
            print(f"syscall-kernel rebase: {exc}", file=sys.stderr)
            return 1
        if found is None:
            print(f"syscall-kernel rebase: {ws.path} has no commit yet", file=sys.stderr)
            return 1
        with store.transaction():
            S.rebase(store, ws.key, found.commit, found.tree)
    finally:
        store.close()
    print(
        f"submit base of {ws.path} is now {found.commit} (tree {found.tree} in the kernel's repository "
        f"{repo.path}, held as {base_ref(found.tree)}); measurements of the old base are no longer reused"
    )
    return 0


def _sleep_status(store: Store, key: str, s: SleepRow) -> SleepStatus:
    tasks = tuple(TaskStatus(j.launch, j.task, j.state, j.job_id) for j in store.jobs_of(key, s.seq))
    return SleepStatus(s.id, s.seq, s.state, s.created_at, tasks)


def _status(cfg: Config) -> KernelStatus:
    store = Store.open(cfg.paths.store, readonly=True)
    try:
        out = []
        for ws in store.workspaces():
            s = store.current_sleep(ws.key)
            sleep = None if s is None else _sleep_status(store, ws.key, s)
            flying = tuple(_sleep_status(store, ws.key, f) for f in store.sleeps_in_flight(ws.key))
            c = ws.policy.submit
            trust = "none" if c is None else "trusted" if is_trusted(c, cfg.jail) else "self-reported"
            paused = store.admin(ws.key).paused_at
            run_b, res_b, whole = retention.usage(cfg.run_dir, ws)
            out.append(
                WorkspaceStatus(
                    ws.key,
                    ws.path,
                    ws.watch,
                    ws.problem,
                    _budget(ws.balance),
                    sleep,
                    trust,
                    paused,
                    run_b,
                    res_b,
                    whole,
                    store.pruned_count(ws.key),
                    flying,
                )
            )
        counts = store.counts()
        return KernelStatus(
            cfg.state_dir,
            statedir.holder(cfg.state_dir),
            statedir.note(cfg.state_dir),
            tuple(out),
            counts["live_sleeps"],
            counts["live_jobs"],
            counts["requests"],
            store.pending_note(),
        )
    finally:
        store.close()


def _budget(b: Balance) -> dict[str, float | int]:
    m = b.to_message()
    return {
        "launches": m.launches,
        "sleeps": m.sleeps,
        "gpu_hours": m.gpu_hours,
        "reserved_gpu_hours": m.reserved_gpu_hours,
    }


def _status_config(args: argparse.Namespace) -> Config:
    """The config `status` reads the state by: `--state-dir` over the built-in defaults, else the config file."""
    if args.state_dir is None:
        try:
            return _config(args.config)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} (`syscall-kernel status --state-dir DIR` reads a state dir without the config file)"
            ) from None
    return parse(f"state_dir = {json.dumps(os.path.abspath(args.state_dir))}\n", "<--state-dir>")


def cmd_status(args: argparse.Namespace) -> int:
    cfg = _status_config(args)
    try:
        st = _status(cfg)
    except StoreError as exc:
        print(f"syscall-kernel status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(msgspec.json.encode(st).decode() + "\n")
        return 0
    print(f"state: {st.state_dir}")
    if st.migration_pending is not None:
        print(f"store: {st.migration_pending}")
    if st.kernel_pid is None:
        print("kernel: NOT running (no process holds the state dir's lock)")
    else:
        print(f"kernel: running (pid {st.kernel_pid or 'unknown'}): {st.kernel_status or ''}")
    print(
        f"{len(st.workspaces)} workspaces, {st.live_sleeps} sleeps and {st.live_jobs} jobs in flight, "
        f"{st.requests} requests recorded"
    )
    for w in st.workspaces:
        b = w.budget
        print(f"- {w.key}  {w.path}  [{w.watch}]")
        print(
            f"    budget: {b['launches']} launches, {b['sleeps']} sleeps, {b['gpu_hours']:g} GPU-hours "
            f"({b['reserved_gpu_hours']:g} reserved)"
        )
        at_least = "" if w.disk_complete else "at least "
        pruned = f"; {w.pruned_sleeps} older sleeps pruned" if w.pruned_sleeps else ""
        print(
            f"    disk: {at_least}{_size(w.run_bytes)} in run directories, {at_least}{_size(w.result_bytes)} "
            f"in results/{pruned}"
        )
        if w.paused_at:
            print(f"    PAUSED since {w.paused_at} (`syscall-kernel resume` serves it again)")
        if w.problem:
            print(f"    problem: {w.problem}")
        if w.submit == "self-reported":
            print(f"    warning: {SELF_REPORTED_WARNING}")
        for shown in w.in_flight or ((w.sleep,) if w.sleep is not None else ()):
            states: dict[str, int] = {}
            for t in shown.tasks:
                states[t.state] = states.get(t.state, 0) + 1
            summary = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "no tasks"
            print(f"    sleep {shown.id} (seq {shown.seq}): {shown.state}; {summary}")
            jobs = sorted({t.job_id for t in shown.tasks if t.job_id})
            if jobs:
                print(f"    jobs: {' '.join(jobs)}")
    return 0


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x, units = n / 1024, ["KiB", "MiB", "GiB"]
    while x >= 1024 and len(units) > 1:
        x, units = x / 1024, units[1:]
    return f"{x:.1f} {units[0]}"


def cmd_check(args: argparse.Namespace) -> int:
    from kernel.service.check import run_checks

    try:
        cfg = _config(args.config)
    except ConfigError as exc:
        print(f"error   config: {exc}")
        return 1
    findings = run_checks(cfg)
    for f in findings:
        if args.json:
            sys.stdout.write(
                msgspec.json.encode({"level": f.level, "what": f.what, "detail": f.detail}).decode() + "\n"
            )
        else:
            print(f"{f.level:<7} {f.what}: {f.detail}")
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warn" for f in findings)
    if not args.json:
        print(f"{errors} error(s), {warnings} warning(s)")
    return 1 if errors else 0


def _writable_store(cfg: Config) -> Store:
    """The store for a command that writes: migrated here only while no kernel serves it (a kernel of the older
    release would run on over a store it did not make, and refuse it at its next start)."""
    return Store.open(cfg.paths.store, migrate=statedir.holder(cfg.state_dir) is None)


def _admin_store(cfg: Config, verb: str) -> Store | None:
    try:
        statedir.prepare(cfg.state_dir, create=False)
        return _writable_store(cfg)
    except (StoreError, OSError, statedir.StateDirError) as exc:
        print(f"syscall-kernel {verb}: {exc}", file=sys.stderr)
        return None


def cmd_unenroll(args: argparse.Namespace) -> int:
    from kernel.io import admin

    cfg = _config(args.config)
    store = _admin_store(cfg, "unenroll")
    if store is None:
        return 1
    try:
        row = admin.unenroll(store, args.workspace, force=args.force)
        live = store.current_sleep(row.key)
    except admin.AdminError as exc:
        print(f"syscall-kernel unenroll: refused: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(f"unenrolled {row.path} ({row.key}): its channel is removed; its records stay in the store")
    if live is not None:
        pid = statedir.holder(cfg.state_dir)
        who = (
            "no kernel runs on this state dir: the next `serve` cancels"
            if pid is None
            else f"the running kernel (pid {pid or 'unknown'}) cancels"
        )
        print(
            f"  sleep {live.id} (seq {live.seq}) was in flight: {who} its jobs and ends it (`syscall-kernel "
            "history` shows it; its wake stays in the store)"
        )
    print(f"  `syscall-kernel enroll {row.path}` enrolls it again (with the budget it had)")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    from kernel.io import admin

    store = _admin_store(_config(args.config), args.command)
    if store is None:
        return 1
    try:
        row, changed = admin.set_paused(store, args.workspace, args.command == "pause")
    except admin.AdminError as exc:
        print(f"syscall-kernel {args.command}: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    state = "paused: requests wait unanswered" if args.command == "pause" else "served again"
    print(f"{row.path} ({row.key}) is {state}{'' if changed else ' (it already was)'}")
    return 0


def cmd_budget(args: argparse.Namespace) -> int:
    from kernel.io import admin

    edit = admin.BudgetEdit(
        add={k: v for k in admin.BUDGET_KINDS if (v := getattr(args, f"add_{k}")) is not None},
        set={k: v for k in admin.BUDGET_KINDS if (v := getattr(args, f"set_{k}")) is not None},
    )
    cfg = _config(args.config)
    store = _admin_store(cfg, "budget")
    if store is None:
        return 1
    try:
        row, before, after, published = admin.change_budget(store, args.workspace, edit, admin.who())
    except admin.AdminError as exc:
        print(f"syscall-kernel budget: refused: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    b, a = before.to_message(), after.to_message()
    if published is None:
        print(
            f"budget of {row.path} ({row.key}) unchanged by {edit.describe()}: {a.launches} launches, {a.sleeps} "
            f"sleeps, {a.gpu_hours:g} GPU-hours (GPU-hours are kept in whole GPU-seconds, "
            f"{1 / GPU_SECONDS_PER_HOUR:.6f} GPU-hours each); nothing recorded"
        )
        return 0
    print(f"budget of {row.path} ({row.key}): {edit.describe()}")
    print(f"  was: {b.launches} launches, {b.sleeps} sleeps, {b.gpu_hours:g} GPU-hours")
    print(f"  now: {a.launches} launches, {a.sleeps} sleeps, {a.gpu_hours:g} GPU-hours")
    print(_budget_shown(published, cfg))
    return 0


def _budget_shown(published: Published, cfg: Config) -> str:
    """For the operator: when budget.json shows the balance just recorded (kernel.io.enroll.publish_budget)."""
    if published.how == "written":
        return "  budget.json rewritten"
    if published.how == "kernel":
        return (
            f"  budget.json: the running kernel (pid {published.kernel}) rewrites it within poll_seconds "
            f"({cfg.poll_seconds:g} s), in the order of its own writes, while it serves the workspace "
            "(`syscall-kernel status` shows a problem that keeps it from serving it; it rewrites it once served)"
        )
    return (
        f"  budget.json not rewritten ({published.why}); the change is recorded, and a kernel rewrites "
        "budget.json from the store when it next serves the workspace"
    )


def cmd_history(args: argparse.Namespace) -> int:
    cfg = _config(args.config)
    if args.limit < 1:
        print(f"syscall-kernel history: --limit must be >= 1, got {args.limit}", file=sys.stderr)
        return 2
    try:
        store = Store.open(cfg.paths.store, readonly=True)
    except StoreError as exc:
        print(f"syscall-kernel history: {exc}", file=sys.stderr)
        return 1
    try:
        rows = store.workspaces()
        if args.workspace is not None:
            row = store.workspace_by_path(os.path.realpath(args.workspace)) or store.workspace(args.workspace)
            if row is None:
                print(f"syscall-kernel history: {args.workspace} was never enrolled", file=sys.stderr)
                return 1
            rows = [row]
        key = rows[0].key if args.workspace is not None else None
        if args.verdicts:
            found = S.verdicts(store, workspace=key)
            shown = {(v.workspace, v.seq): _shown_verdict(store, v.workspace, v.seq) for v in found}
            return _print_verdicts(found, shown, as_json=args.json)
        if not args.budget:
            return _sleep_history(store, rows, args.limit, as_json=args.json)
        changes = store.budget_changes(key)
    finally:
        store.close()
    for c in changes:
        if args.json:
            out: dict[str, object] = {"workspace": c.workspace, "at": c.at, "who": c.who, "change": c.change}
            out |= {"before": _budget(c.before), "after": _budget(c.after)}
            sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        else:
            a = c.after.to_message()
            print(
                f"{c.at}  {c.workspace}  by {c.who}: {c.change} -> {a.launches} launches, {a.sleeps} sleeps, "
                f"{a.gpu_hours:g} GPU-hours"
            )
    if not changes and not args.json:
        print("no budget changes recorded")
    return 0


def _sleep_history(store: Store, rows: list[WorkspaceRow], limit: int, *, as_json: bool) -> int:
    """`history` without --budget: per workspace, its requests recorded and its latest `limit` sleeps."""
    for ws in rows:
        sleeps = store.sleeps(ws.key, limit)
        requests = store.count_requests(ws.key)
        if not as_json:
            print(
                f"{ws.key}  {ws.path}: {requests} requests recorded; {len(sleeps)} latest sleeps, newest first"
            )
        for s in sleeps:
            states: dict[str, int] = {}
            for j in store.jobs_of(ws.key, s.seq):
                states[j.state] = states.get(j.state, 0) + 1
            if as_json:
                out = {"workspace": ws.key, "seq": s.seq, "id": s.id, "state": s.state}
                out |= {"created_at": s.created_at, "woken_at": s.woken_at, "tasks": states, "note": s.note}
                sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
                continue
            tasks = ", ".join(f"{n} {st}" for st, n in sorted(states.items())) or "no tasks"
            ended = f" -> {s.woken_at}" if s.woken_at else ""
            note = f"  {s.note!r}" if s.note else ""
            print(f"  seq {s.seq}  {s.id}  {s.state}  {s.created_at}{ended}  {tasks}{note}")
        if not sleeps and not as_json:
            print("  no sleeps recorded")
    if not rows and not as_json:
        print("no workspaces enrolled")
    return 0


def _shown_verdict(store: Store, workspace: str, seq: int) -> Verdict | None:
    """The verdict the agent's wake carried (what `[verdicts] disclosure` showed of the exact one)."""
    sleep = store.sleep(workspace, seq)
    return None if sleep is None or sleep.verdict is None else S.stored_verdict(sleep.verdict)


def _print_verdicts(
    found: list[S.StoredVerdict], shown: dict[tuple[str, int], Verdict | None], *, as_json: bool
) -> int:
    """The operator's record of verdicts: exact values, and what the agent was shown of each."""
    for sv in found:
        v = sv.verdict
        seen = shown.get((sv.workspace, sv.seq))
        if as_json:
            head = {"workspace": sv.workspace, "seq": sv.seq, "sleep": sv.sleep_id, "report": sv.report}
            body = {
                "verdict": msgspec.to_builtins(v),
                "shown": None if seen is None else msgspec.to_builtins(seen),
            }
            sys.stdout.write(msgspec.json.encode(head | body).decode() + "\n")
            continue
        values = ""
        if v.base_value is not None and v.candidate_value is not None and v.delta is not None:
            values = f": base {v.base_value!r}, candidate {v.candidate_value!r}, delta {v.delta!r}"
        test = ""
        if v.p_value is not None:
            test = f", sign test p = {v.p_value!r}"
        elif v.lower_bound is not None:
            test = f", bootstrap lower bound {v.lower_bound!r}"
        seeds = f", on the seeds of submit #{v.seeds_from_seq}" if v.seeds_from_seq is not None else ""
        agent = ""
        if seen is not None and seen.disclosure != "exact":
            value = "" if seen.delta is None else f", delta {seen.delta!r}"
            agent = f"; the agent was shown ({seen.disclosure}): {seen.outcome}{value}"
        print(f"{sv.workspace}  #{sv.seq} {sv.sleep_id}: {v.outcome}{values}{test}{seeds}{agent}")
    if not found and not as_json:
        print("no verdicts recorded")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kernel import demo

    return demo.run(keep=args.keep)


def main(argv: Sequence[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        args = _parser().parse_args(argv)
        rc = _HANDLERS[args.command](args)
        # Flushed here, not at exit: a reader gone (`status | head`) is a BrokenPipeError caught below.
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except ConfigError as exc:
        print(f"syscall-kernel: bad config: {exc}", file=sys.stderr)
        return 2
    except sqlite3.Error as exc:
        # The state store cannot be read or written (a full disk: `disk I/O error` even to read it).
        assert args is not None
        cfg = _config(args.config)
        print(
            f"syscall-kernel {args.command}: {statedir.store_unusable(cfg.state_dir, cfg.paths.store, exc)}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130


def _stdout_closed() -> int:
    """stdout's reader went away (`status | head`): quietly, as a command killed by SIGPIPE would. stdout is
    pointed at /dev/null first, so the interpreter's own flush at exit has nothing left to fail on."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return 128 + signal.SIGPIPE


_HANDLERS: Final[dict[str, Callable[[argparse.Namespace], int]]] = {
    "serve": cmd_serve,
    "enroll": cmd_enroll,
    "rebase": cmd_rebase,
    "status": cmd_status,
    "check": cmd_check,
    "unenroll": cmd_unenroll,
    "pause": cmd_pause,
    "resume": cmd_pause,
    "budget": cmd_budget,
    "history": cmd_history,
    "demo": cmd_demo,
    **dict.fromkeys(SHIPPED, cmd_shipped),
}


if __name__ == "__main__":
    sys.exit(main())
