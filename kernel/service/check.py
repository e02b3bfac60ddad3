"""`syscall-kernel check`: what would go wrong with this config, found before the first sleep does.

Each finding is `ok`, `warn` (works, but probably not as meant) or `error` (the kernel would refuse to start, or
a sleep would fail). Nothing is created or changed: the state and run dirs are examined, not made; the lock is
read, not taken; Slurm is asked only read-only questions (`scontrol show partition`, `sacctmgr show`).
"""

from __future__ import annotations

import os
import resource
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from channel import safefs
from channel.messages import EvalContract
from kernel.backends.slurm.query import NO_CONFIG_SOURCE, partition_argv, ping_argv, sacctmgr_argv
from kernel.core.config import Config
from kernel.core.evaluate import contract_problem, contract_warnings, disclosure_warning
from kernel.io import hostproc, metrics, statedir
from kernel.io import submit as S
from kernel.io.enroll import expand_globs, owner_of
from kernel.io.store import Store, StoreError

Level = Literal["ok", "warn", "error"]


@dataclass(frozen=True, slots=True)
class Finding:
    level: Level
    what: str
    detail: str


def run_checks(cfg: Config, env: dict[str, str] | None = None) -> list[Finding]:
    env = dict(os.environ) if env is None else env
    out = [Finding("ok", "config", f"{cfg.source} loads (backend {cfg.backend}, jail {cfg.jail})")]
    if os.geteuid() == 0 and not cfg.allow_root:
        out.append(Finding("error", "user", "running as root: `serve` refuses unless allow_root = true"))
    paths = cfg.paths
    state = _dir("state_dir", paths.state_dir)
    out += state
    run = paths.run_dir
    if not run.exists() and run.is_relative_to(paths.state_dir) and not paths.state_dir.is_dir():
        # Made by `serve` inside the state dir, after it: it can be made exactly when the state dir can.
        ok = all(f.level == "ok" for f in state)
        out.append(
            Finding(
                "ok" if ok else "error",
                "run_dir",
                f"{run} is inside state_dir; it will be created with it"
                if ok
                else f"{run} is inside state_dir, which cannot be created (see state_dir)",
            )
        )
    else:
        out += _dir("run_dir", run, parents=True)
    out += _lock(cfg)
    out += _globs(cfg)
    out += _workspaces(cfg)
    out += _capacity(cfg)
    out += _jail(cfg)
    out += _metrics(cfg)
    out += _submit(cfg)
    if cfg.backend == "slurm":
        out += _slurm(cfg, env)
    return out


def _dir(key: str, p: Path, *, parents: bool = False) -> list[Finding]:
    """A directory the kernel writes: there and writable, or makeable (the state dir only in an existing
    parent; the run dir, made with its parents, in the nearest existing ancestor)."""
    if p.is_dir():
        if os.access(p, os.W_OK | os.X_OK):
            return [Finding("ok", key, f"{p} is a writable directory")]
        return [Finding("error", key, f"{p} is not writable by uid {os.geteuid()}")]
    if p.exists() or p.is_symlink():
        return [Finding("error", key, f"{p} is not a directory")]
    base = p.parent
    while parents and not base.exists() and base != base.parent:
        base = base.parent
    if base.is_dir() and os.access(base, os.W_OK | os.X_OK):
        return [Finding("ok", key, f"{p} does not exist yet; it will be created (in {base})")]
    return [
        Finding("error", key, f"{p} does not exist, and {base} is not a writable directory to make it in")
    ]


def _lock(cfg: Config) -> list[Finding]:
    try:
        pid = statedir.holder(cfg.state_dir)
    except statedir.StateDirError as exc:
        return [Finding("error", "lock", str(exc))]
    if pid is None:
        return [Finding("ok", "lock", "no kernel holds the state dir (a `serve` may start)")]
    return [
        Finding(
            "ok", "lock", f"held by the running kernel, pid {pid or 'unknown'}; a second serve would exit 2"
        )
    ]


def _globs(cfg: Config) -> list[Finding]:
    if not cfg.workspaces:
        return [Finding("ok", "workspaces", "no globs: workspaces are enrolled with `syscall-kernel enroll`")]
    out = []
    mine, known = _own_store(cfg)
    for pattern in cfg.workspaces:
        matches = expand_globs((pattern,))
        n = len(matches)
        for path in matches:
            if path in known:
                continue  # enrolled here already: served, whatever its kernel.json says now
            other = _owned_elsewhere(path, mine)
            if other is not None:
                out.append(Finding("warn", "workspaces", f"{pattern!r} matches {path}, but {other}"))
        if n:
            out.append(
                Finding("ok", "workspaces", f"{pattern!r} matches {n} director{'y' if n == 1 else 'ies'}")
            )
        else:
            out.append(
                Finding("warn", "workspaces", f"{pattern!r} matches nothing (a typo, or not created yet?)")
            )
    return out


def _own_store(cfg: Config) -> tuple[str | None, set[str]]:
    """This config's store id (None: no store yet) and every workspace path it has a row for."""
    if not cfg.paths.store.exists():
        return None, set()
    try:
        store = Store.open(cfg.paths.store, readonly=True)
    except (StoreError, sqlite3.Error):
        return None, set()  # reported by _workspaces
    try:
        return store.store_id(), store.workspace_paths()
    except sqlite3.Error:
        return None, set()
    finally:
        store.close()


def _owned_elsewhere(path: str, mine: str | None) -> str | None:
    """Why `serve` would not enroll the glob match `path`: its channel's kernel.json names another store as its
    owner (kernel.io.enroll.OwnedElsewhere); None when it names this one, none, or there is no channel yet."""
    try:
        with safefs.open_channel(path) as ch:
            found = owner_of(ch)
    except (safefs.ChannelMoved, safefs.Refused, OSError):
        return None  # no channel (the enrollment makes one), or not ours to read: the enrollment says why
    if found is None or found.store == mine:
        return None
    return (
        f"its channel is owned by another kernel's store ({found.store}, state_dir {found.state_dir}): this kernel "
        f"will not serve it. Stop that kernel serving it, or `syscall-kernel enroll --take-over {path}`"
    )


def _workspaces(cfg: Config) -> list[Finding]:
    if not cfg.paths.store.exists():
        return []
    try:
        store = Store.open(cfg.paths.store, readonly=True)
    except StoreError as exc:
        return [Finding("error", "store", str(exc))]
    except sqlite3.Error as exc:
        return [Finding("error", "store", statedir.store_unusable(cfg.state_dir, cfg.paths.store, exc))]
    try:
        rows = store.workspaces()
        paused = store.paused()
        pending = store.pending_note()
        own = S.contracts(store)
    except sqlite3.Error as exc:
        return [Finding("error", "store", statedir.store_unusable(cfg.state_dir, cfg.paths.store, exc))]
    finally:
        store.close()
    out = [Finding("ok", "store", f"{len(rows)} workspaces enrolled ({len(paused)} paused)")]
    if pending is not None:
        out.append(Finding("warn", "store", pending))
    out += [Finding("warn", f"workspace {r.key}", f"{r.path}: {r.problem}") for r in rows if r.problem]
    for key, contract in sorted(own.items()):
        out += _contract_findings(f"workspace {key} contract", contract, cfg)
    return out


def _submit(cfg: Config) -> list[Finding]:
    """The default contract's warnings (config load already refused one that cannot be used)."""
    c = cfg.defaults.submit
    return [] if c is None else _contract_findings("defaults.submit", c, cfg)


def _contract_findings(what: str, c: EvalContract, cfg: Config) -> list[Finding]:
    """An error for a contract that cannot be used (one enrolled before a check existed), else its warnings."""
    problem = contract_problem(c)
    if problem is not None:
        return [Finding("error", what, f"{problem[0]}: {problem[1]} (enroll the workspace again to fix it)")]
    out = [Finding("warn", what, w) for w in contract_warnings(c)]
    hidden = disclosure_warning(c, cfg.verdicts)
    if hidden is not None:
        out.append(Finding("warn", what, hidden))
    return out


# Fds the kernel needs besides one per served channel (its lock): the store, inotify, pipes to git, threads.
FD_MARGIN = 256
MAX_USER_WATCHES = "/proc/sys/fs/inotify/max_user_watches"


def _capacity(cfg: Config) -> list[Finding]:
    """Whether this machine's limits hold every workspace the kernel would serve (the globs' matches and those
    enrolled): one open fd per channel (its lock; `serve` raises the soft limit to the hard one) and one inotify
    watch per channel not polled."""
    paths = set(expand_globs(cfg.workspaces))
    if cfg.paths.store.exists():
        try:
            store = Store.open(cfg.paths.store, readonly=True)
        except (StoreError, sqlite3.Error):
            store = None  # reported by _workspaces
        if store is not None:
            try:
                paths |= {r.path for r in store.workspaces()}
            except sqlite3.Error:
                pass  # reported by _workspaces
            finally:
                store.close()
    n = len(paths)
    if not n:
        return []
    out = []
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < n + FD_MARGIN:
        out.append(
            Finding(
                "error",
                "fds",
                f"{n} workspaces need about {n + FD_MARGIN} open files (one per channel's lock), but the hard "
                f"limit here is {hard}: the channels past it are not served. Raise LimitNOFILE= in the unit "
                "(`syscall-kernel unit` prints the unit: it sets 65536) or the hard `ulimit -n`",
            )
        )
    else:
        out.append(Finding("ok", "fds", f"{n} workspaces; open files hard limit {hard}"))
    if cfg.watch != "poll":
        try:
            watches = int(Path(MAX_USER_WATCHES).read_text().strip())
        except (OSError, ValueError):
            watches = None
        if watches is not None and watches < n:
            out.append(
                Finding(
                    "warn",
                    "inotify",
                    f"{n} workspaces but fs.inotify.max_user_watches is {watches} (shared by all of this user's "
                    "processes): the channels past it are polled every poll_seconds instead of watched. Raise it "
                    "(sysctl fs.inotify.max_user_watches)",
                )
            )
        elif watches is not None:
            out.append(Finding("ok", "inotify", f"{n} workspaces; fs.inotify.max_user_watches {watches}"))
    return out


def _metrics(cfg: Config) -> list[Finding]:
    """Whether `serve` could listen on `metrics_listen` (bound and closed here): a port another user's kernel
    holds is the usual mistake of one config copied for every user."""
    if not cfg.metrics_listen:
        return []
    problem = metrics.bind_problem(cfg.metrics_listen)
    if problem is None:
        return [Finding("ok", "metrics", f"{cfg.metrics_listen} is free: `serve` can listen on it")]
    try:
        mine = statedir.holder(cfg.state_dir)
    except statedir.StateDirError:
        mine = None
    _, _, port = cfg.metrics_listen.rpartition(":")
    if mine and any(mine in metrics.socket_pids(i) for _, i in metrics.listening_sockets(int(port))):
        return [
            Finding("ok", "metrics", f"{cfg.metrics_listen} is served by this config's kernel, pid {mine}")
        ]
    return [
        Finding(
            "warn",
            "metrics",
            f"metrics_listen {problem}: `serve` would log metrics_failed and run without metrics. Give each "
            "user's kernel a port of its own (docs/operator.md, Metrics: one port per user)",
        )
    ]


def _jail(cfg: Config) -> list[Finding]:
    if cfg.jail == "none":
        return [Finding("warn", "jail", "jail = 'none': jobs run unconfined (a single-user laptop only)")]
    if cfg.jail == "apptainer":
        found = shutil.which("apptainer")
        ok = found is not None and Path(cfg.apptainer_image).exists()
        why = "apptainer and the image are there" if ok else "apptainer or apptainer_image is missing"
        return [Finding("ok" if ok else "error", "jail", why)]
    problem = bwrap_problem()
    if problem is not None:
        return [Finding("error", "jail", problem)]
    return [Finding("ok", "jail", f"bwrap works ({shutil.which('bwrap')})")]


def bwrap_problem() -> str | None:
    """Why bwrap cannot jail a job on this host (it is missing, or cannot make its namespaces: its own message), or
    None when a jailed `true` (every namespace unshared, as a job's) runs."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    probe = _run([exe, "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"])
    if probe is not None and probe.returncode == 0:
        return None
    detail = "did not answer" if probe is None else (probe.stderr.strip().splitlines() or ["?"])[-1]
    return (
        f"bwrap cannot make its namespaces here: {detail} (sysctl kernel.unprivileged_userns_clone=1, or "
        "kernel.apparmor_restrict_unprivileged_userns=0; under systemd, a unit setting that hides /proc/sys, "
        "mounts over part of /proc (ProtectKernelTunables=, ProtectKernelLogs=) or forbids AF_NETLINK sockets)"
    )


def _slurm(cfg: Config, env: dict[str, str]) -> list[Finding]:
    s = cfg.slurm
    out: list[Finding] = []
    if shutil.which("sbatch", path=env.get("PATH")) is None:
        return [Finding("error", "slurm", "sbatch is not on PATH: the Slurm clients are not installed here")]
    ping = _run(ping_argv(), env)
    if ping is None or ping.returncode != 0:
        # Every other question would fail the same way: this is the one finding.
        return [_no_controller(ping, env)]
    out.append(Finding("ok", "slurm", "the controller answers `scontrol ping`"))
    for partition in (s.partition or "").split(",") if s.partition else []:
        done = _run(partition_argv(partition), env)
        if done is None:
            out.append(Finding("error", "slurm.partition", "scontrol did not answer: is slurmctld up?"))
        elif done.returncode == 0 and f"PartitionName={partition} " in done.stdout + " ":
            out.append(Finding("ok", "slurm.partition", f"{partition!r} exists"))
        else:
            why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
            out.append(Finding("error", "slurm.partition", f"{partition!r} is not known to Slurm: {why}"))
    names: list[tuple[str, str | None, str]] = [
        ("account", s.account, "slurm.account"),
        ("qos", s.qos, "slurm.qos"),
    ]
    names += [("account", a, f"workspace {ws} account") for ws, a in sorted(_workspace_accounts(cfg).items())]
    for kind, name, key in names:
        if name is None:
            continue
        done = _run(sacctmgr_argv(kind, name), env)  # type: ignore[arg-type]
        if done is None or done.returncode != 0:
            why = (
                "did not answer"
                if done is None
                else (" ".join(done.stderr.split()) or f"exit {done.returncode}")
            )
            out.append(Finding("warn", key, f"cannot ask sacctmgr about {name!r} ({why}); not checked"))
        elif name.lower() in {line.strip().lower() for line in done.stdout.splitlines()}:
            out.append(Finding("ok", key, f"{name!r} exists"))
        else:
            out.append(
                Finding("error", key, f"{name!r} is not known to Slurm's accounting (sacctmgr show {kind})")
            )
    return out


def _no_controller(ping: hostproc.CompletedProcess[str] | None, env: dict[str, str]) -> Finding:
    if ping is None:
        return Finding("error", "slurm", "`scontrol ping` did not answer: is slurmctld up and reachable?")
    text = ping.stderr + ping.stdout
    if NO_CONFIG_SOURCE in text:
        conf = env.get("SLURM_CONF")
        where = f"SLURM_CONF={conf}" if conf else "SLURM_CONF is not set, and the clients' default slurm.conf"
        return Finding(
            "error",
            "slurm",
            f"no Slurm controller found: {where} cannot be read, and no DNS SRV record (configless Slurm) "
            "names one. Set SLURM_CONF to the cluster's slurm.conf where the kernel runs (the unit's "
            "Environment=), or install it where the clients look",
        )
    why = next((line.strip() for line in text.splitlines() if line.strip()), f"exit {ping.returncode}")[:300]
    return Finding(
        "error",
        "slurm",
        f"the controller does not answer `scontrol ping`: {why} (is slurmctld running, and reachable from here?)",
    )


def _workspace_accounts(cfg: Config) -> dict[str, str]:
    """The enrolled workspaces' own Slurm accounts (`enroll --account`)."""
    if not cfg.paths.store.exists():
        return {}
    try:
        store = Store.open(cfg.paths.store, readonly=True)
    except (StoreError, sqlite3.Error):
        return {}  # reported by _workspaces
    try:
        return {ws.key: a for ws in store.workspaces() if (a := store.slurm_account(ws.key)) is not None}
    except sqlite3.Error:
        return {}  # reported by _workspaces
    finally:
        store.close()


def _run(argv: list[str], env: dict[str, str] | None = None) -> hostproc.CompletedProcess[str] | None:
    try:
        got = hostproc.run(hostproc.TOOL_QUERY, argv, env=env)
    except (OSError, hostproc.TimeoutExpired, hostproc.OutputTooLarge):
        return None
    return hostproc.CompletedProcess(
        got.args, got.returncode, got.stdout.decode("utf-8", "replace"), got.stderr.decode("utf-8", "replace")
    )
