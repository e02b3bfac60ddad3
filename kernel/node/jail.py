"""The jail a job's command runs in: pure argv and env builders for bwrap, apptainer and none.

The jailed process is hostile (threat-model.md): it must see only its own tree (read-write), a scratch home and
tmp, and read-only system directories; never the run directory, the kernel's state or another workspace; no
network unless the policy allows it; no capability; a new session (no `TIOCSTI` into the kernel's terminal); an
environment built from an allowlist, never inherited. Visibility is decided by what is bound in, so the run
directory, the state directory and the workspaces are simply never bound; `hide` masks any of them that happens to
live below a directory that is bound (an operator who puts `state_dir` under `/opt`, say).

The argv is built here and rendered into the job wrapper by `kernel.backends.jobscript`; paths that only exist on the node
(the scratch tree) and env values only known there (the array index, `CUDA_VISIBLE_DEVICES`) are filled in by the
wrapper through the tokens below.

`build_bwrap_argv` is the jail of the kernel's own locked-environment build (kernel.io.envcache), on the kernel's
host: uv and the byte-compilation read what the agent's lockfile named, so they get this module's rules too.
No task builds an environment: the entry's venv is bound read-only into its jail (VENV_TOKEN, VENV_SOURCE_TOKEN).
`listing_bwrap_argv` is the jail of the snapshot's git listing (kernel.io.gitlisting), on the kernel's host too:
git walks the agent's live tree there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

JailKind = Literal["bwrap", "apptainer", "none"]

# Tokens the wrapper replaces (whole arguments only) on the node.
TREE_TOKEN: Final = "@@SYSCALL_TREE@@"
HOME_TOKEN: Final = "@@SYSCALL_HOME@@"
WORK_TOKEN: Final = "@@SYSCALL_WORK@@"
ENV_TOKEN: Final = "@@SYSCALL_ENV@@"
COMMAND_TOKEN: Final = "@@SYSCALL_COMMAND@@"
SCORER_TOKEN: Final = "@@SYSCALL_SCORER@@"
SCORE_DATA_TOKEN: Final = "@@SYSCALL_SCORE_DATA@@"
# The locked environment's venv as the job sees it (kernel.io.envcache): a whole argument, or the start of an env
# value (`<venv>/bin:...`); SHARED_VENV in a bwrap or apptainer jail, the entry's own path with jail = none.
VENV_TOKEN: Final = "@@SYSCALL_VENV@@"
# Where the venv is bound from (a whole argument): the cache entry's `venv/`, `JobEnvironment.venv`.
VENV_SOURCE_TOKEN: Final = "@@SYSCALL_VENV_SOURCE@@"
# Where a warm cache entry is mounted while the kernel builds it in bwrap (kernel.io.envcache), so that the venv
# it keeps (SHARED_VENV, whose paths the venv embeds) works unchanged when each job's jail binds it there:
# one mount for the cache and the venv, so uv installs by hard link.
SHARED_ENV_ROOT: Final = "/syscall-env"
SHARED_VENV: Final = SHARED_ENV_ROOT + "/venv"
# Expands to the bind arguments of the GPU device nodes the node gave the task (kernel.node.wrapper.gpu_binds).
GPU_TOKEN: Final = "@@SYSCALL_GPUS@@"

JAIL_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_LANG: Final = "C.UTF-8"
SEED_VAR: Final = "EVAL_SEED"
# What the score stage is told (kernel.core.evaluate: the operator's `score` command).
TREE_VAR: Final = "EVAL_TREE"
SCORER_VAR: Final = "SCORER"
SCORE_DATA_VAR: Final = "SCORE_DATA"
INDEX_VARS: Final = ("SWEEP_INDEX", "SLURM_ARRAY_TASK_ID")
# Set by the wrapper for every task (`syscall env` lists them with INDEX_VARS).
LAUNCH_VAR: Final = "SYSCALL_LAUNCH"
TASK_VAR: Final = "SYSCALL_TASK"
SLEEP_VAR: Final = "SYSCALL_SLEEP"
SNAPSHOT_VAR: Final = "SYSCALL_SNAPSHOT"
# What CUDA reads outside /dev when a task has GPUs (read-only; each bound only where it exists).
GPU_PROC: Final = "/proc/driver/nvidia"
GPU_CONTROL: Final = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
GPU_SYS: Final = ("/sys/bus/pci", "/sys/devices", "/sys/dev", "/sys/module", "/sys/class/drm")
# Forwarded from the node's environment when set there (the scheduler assigns GPUs).
FORWARD_VARS: Final = ("CUDA_VISIBLE_DEVICES",)

DEFAULT_SYSTEM_DIRS: Final = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
# /etc is bound file by file: the rest of it (shadow, ssh host keys, the kernel's own config) stays out of sight.
DEFAULT_ETC: Final = (
    "/etc/alternatives",
    "/etc/ca-certificates",
    "/etc/ssl",
    "/etc/group",
    "/etc/passwd",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/hosts",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/mime.types",
    "/etc/protocols",
    "/etc/services",
    "/etc/timezone",
)
NETWORK_ETC: Final = ("/etc/resolv.conf", "/etc/gai.conf")

NONE_WARNING: Final = (
    "jail = 'none': jobs run WITHOUT a jail and can read the kernel's state, the run directories and every "
    "workspace this user can; use only on a single-user laptop"
)


class JailPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How jobs are jailed; the kernel config chooses it (`none` only when it says so explicitly)."""

    kind: JailKind = "bwrap"
    network: bool = False
    image: str | None = None  # the apptainer image
    bwrap: str = "bwrap"
    apptainer: str = "apptainer"
    system_dirs: tuple[str, ...] = DEFAULT_SYSTEM_DIRS
    etc: tuple[str, ...] = DEFAULT_ETC
    hide: tuple[str, ...] = ()  # kernel directories to mask if they lie below a bound directory
    venv: bool = False  # the locked environment's venv (VENV_TOKEN) is bound read-only and put first on PATH
    ro_dirs: tuple[str, ...] = ()  # more read-only directories (environment.extra_dirs, uv-managed Pythons)
    tmp_mb: int = 0  # the size of the jail's /tmp (0: the tmpfs default, half the RAM)
    shm_mb: int = 0  # the size of the jail's /dev/shm (0: the tmpfs default)
    # Per task, enforced by the wrapper (kernel.node.wrapper.Limiter), 0 = none: memory (MB) and processes.
    mem_mb: int = 0
    max_procs: int = 0
    # Per task, enforced by the wrapper, 0 = none: CPUs (a CPU-time quota where a cgroup can be made, else the
    # task is pinned to that many of the node's CPUs).
    cpus: int = 0
    # What a job may put on disk in its tree, home and work directories together (MiB), and the largest file it
    # may write anywhere; 0 = none (kernel.node.wrapper.TreeWatch, RLIMIT_FSIZE). The local backend's.
    tree_mb: int = 0


def with_resources(policy: JailPolicy, mem_mb: int | None, cpus: int | None) -> JailPolicy:
    """The policy of a task whose launch asked for its own memory (MB) and CPUs (None: the policy's, the site's
    default): the memory limit is the launch's (and /dev/shm, a tmpfs counted in it, half of it, as the site's)."""
    if mem_mb is None and cpus is None:
        return policy
    return msgspec.structs.replace(
        policy,
        mem_mb=policy.mem_mb if mem_mb is None else mem_mb,
        shm_mb=policy.shm_mb if mem_mb is None else mem_mb // 2,
        cpus=policy.cpus if cpus is None else cpus,
    )


class JobEnvironment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The locked environment a job uses, a warm cache entry's (part of the JobSpec and job.sh)."""

    uv: str  # the uv binary, on a path the node sees
    cache: str  # <entry>/uv
    project: str  # <entry>/project
    python: str
    python_install_dir: str | None = None  # set when the interpreter is uv-managed (bound read-only)
    lock_sha256: str = ""
    # <entry>/venv, read-only: a bwrap or apptainer jail binds it read-only at SHARED_VENV (where bwrap built it;
    # relocatable otherwise), jail = none uses it where it is. None only in a spec recorded by a kernel whose
    # tasks each synced a venv of their own (before cache key v4): such a job.sh carries its own wrapper.
    venv: str | None = None


@dataclass(frozen=True, slots=True)
class JailPaths:
    """Where the job's tree and scratch live on the node (same path inside the jail)."""

    tree: str
    home: str
    work: str


TEMPLATE_PATHS: Final = JailPaths(TREE_TOKEN, HOME_TOKEN, WORK_TOKEN)


def jail_env(
    *,
    home: str,
    task_index: int | None = None,
    eval_seed: str | None = None,
    forwarded: Mapping[str, str] | None = None,
    lang: str = DEFAULT_LANG,
    venv: str | None = None,
    path_dirs: Sequence[str] = (),
) -> dict[str, str]:
    """The whole environment of the jailed command: an allowlist, nothing inherited. `venv` (the locked
    environment) and `path_dirs` (the site's extra directories) come before the system's PATH."""
    path = ":".join([*([f"{venv}/bin"] if venv else []), *path_dirs, JAIL_PATH])
    env = {"PATH": path, "LANG": lang, "HOME": home, "TMPDIR": "/tmp"}
    if venv:
        env["VIRTUAL_ENV"] = venv
    if task_index is not None:
        for name in INDEX_VARS:
            env[name] = str(task_index)
    if eval_seed is not None:
        env[SEED_VAR] = eval_seed
    for name in FORWARD_VARS:
        if forwarded is not None and name in forwarded:
            env[name] = forwarded[name]
    return env


def score_env(
    *, home: str, tree: str, scorer: str, data: str | None, lang: str = DEFAULT_LANG
) -> dict[str, str]:
    """The score stage's environment (its seed is added per task by the wrapper, like the command's)."""
    env = {
        "PATH": JAIL_PATH,
        "LANG": lang,
        "HOME": home,
        "TMPDIR": "/tmp",
        TREE_VAR: tree,
        SCORER_VAR: scorer,
    }
    if data is not None:
        env[SCORE_DATA_VAR] = data
    return env


def env_args(kind: JailKind, env: Mapping[str, str]) -> list[str]:
    """The env as jail arguments (the wrapper's copy of this function is tested against this one)."""
    out: list[str] = []
    for key in sorted(env):
        if kind == "bwrap":
            out += ["--setenv", key, env[key]]
        elif kind == "apptainer":
            out += ["--env", f"{key}={env[key]}"]
    return out


def _under(path: str, parent: str) -> bool:
    path, parent = os.path.normpath(path), os.path.normpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _abs(path: str, what: str) -> str:
    if not path.startswith("/") and path not in (
        TREE_TOKEN,
        HOME_TOKEN,
        WORK_TOKEN,
        SCORER_TOKEN,
        VENV_TOKEN,
        VENV_SOURCE_TOKEN,
    ):
        raise ValueError(f"jail {what} must be an absolute path, got {path!r}")
    return path


def _tmpfs(size_mb: int, where: str) -> list[str]:
    return [*(["--size", str(size_mb * 1024 * 1024)] if size_mb > 0 else []), "--tmpfs", where]


def _bwrap_start(policy: JailPolicy, *, network: bool, hostname: str, bound: Sequence[str]) -> list[str]:
    """What every bwrap jail (a job's, the score stage's) starts with: every namespace unshared (the network's
    too unless `network`), no user namespace inside, no capabilities, an empty environment; the system paths
    `bound` read-only, with `policy.hide` masked where it lies below one of them."""
    argv = [
        policy.bwrap,
        "--unshare-user",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--unshare-cgroup",
    ]
    if not network:
        argv.append("--unshare-net")
    argv += ["--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    argv += ["--hostname", hostname]
    for d in bound:
        _abs(d, "system path")
        argv += ["--ro-bind-try", d, d]
    for h in policy.hide:
        _abs(h, "hidden path")
        if any(_under(h, d) for d in bound):
            argv += ["--tmpfs", h]
    return argv


def bwrap_argv(
    policy: JailPolicy,
    paths: JailPaths,
    env: Sequence[str],
    command: str,
    *,
    venv: str | None = None,
    venv_source: str | None = None,
    gpus: int = 0,
    gpu_args: Sequence[str] = (),
) -> list[str]:
    """bwrap argv per slurm.md; `env` is the output of `env_args` (or `[ENV_TOKEN]` in a template); `venv` the
    environment's path in the jail when `policy.venv`, bound from `venv_source` (default: the same path); for a task with `gpus`, `gpu_args` binds its device nodes
    (`gpu_bind_args` on the node, `[GPU_TOKEN]` in a template). A task without GPUs gets no GPU device."""
    tree, home = _abs(paths.tree, "tree"), _abs(paths.home, "home")
    bound = [*policy.system_dirs, *policy.etc, *(NETWORK_ETC if policy.network else ())]
    argv = _bwrap_start(policy, network=policy.network, hostname="syscall-job", bound=bound)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if gpus > 0:
        # Device nodes first, then what CUDA reads from /proc and /sys; /dev then becomes read-only (its tmpfs
        # would otherwise be RAM any job could fill), except /dev/shm which gets its own, sized tmpfs.
        argv += list(gpu_args)
        argv += ["--ro-bind-try", GPU_PROC, GPU_PROC]
        for d in GPU_SYS:
            argv += ["--ro-bind-try", d, d]
    argv += _tmpfs(policy.shm_mb, "/dev/shm")
    argv += ["--remount-ro", "/dev"]
    argv += _tmpfs(policy.tmp_mb, "/tmp")
    # After the fresh /tmp, which would otherwise hide a directory below it.
    argv += _ro_dir_args(policy)
    if policy.venv:
        if venv is None:
            raise ValueError("the jail binds the locked environment but no venv path was given")
        v = _abs(venv, "venv")
        argv += ["--ro-bind", _abs(venv_source or v, "venv source"), v]
    argv += ["--bind", home, home, "--bind", tree, tree, "--chdir", tree]
    argv += list(env)
    argv += ["--", "sh", "-c", command]
    return argv


def apptainer_argv(
    policy: JailPolicy,
    paths: JailPaths,
    env: Sequence[str],
    command: str,
    *,
    gpus: int,
    venv: str | None = None,
    venv_source: str | None = None,
) -> list[str]:
    """apptainer argv per slurm.md (`--containall` does not isolate the network, so `--net --network none`)."""
    if not policy.image:
        raise ValueError("jail 'apptainer' needs an image (jail.image in the kernel config)")
    tree, home, work = _abs(paths.tree, "tree"), _abs(paths.home, "home"), _abs(paths.work, "work")
    argv = [policy.apptainer, "exec", "--containall", "--cleanenv"]
    if not policy.network:
        argv += ["--net", "--network", "none"]
    if gpus > 0:
        argv.append("--nv")
    argv += ["--bind", tree, "--pwd", tree, "--home", home, "--workdir", work]
    for d in policy.ro_dirs:
        argv += ["--bind", f"{_abs(d, 'read-only directory')}:{d}:ro"]
    if policy.venv:
        if venv is None:
            raise ValueError("the jail binds the locked environment but no venv path was given")
        argv += ["--bind", f"{_abs(venv_source or venv, 'venv source')}:{_abs(venv, 'venv')}:ro"]
    argv += list(env)
    argv += [policy.image, "sh", "-c", command]
    return argv


def none_argv(command: str) -> list[str]:
    """No jail: the command runs as the wrapper's child with the allowlisted env and cwd in the tree."""
    return ["sh", "-c", command]


def _ro_dir_args(policy: JailPolicy) -> list[str]:
    """The extra read-only directories, then a tmpfs over each hidden path below one of them (a run directory,
    a workspace or private score data that an operator placed inside an extra directory stays out of sight)."""
    argv: list[str] = []
    for d in policy.ro_dirs:
        _abs(d, "read-only directory")
        argv += ["--ro-bind-try", d, d]
    for h in policy.hide:
        if any(_under(h, d) for d in policy.ro_dirs):
            argv += ["--tmpfs", _abs(h, "hidden path")]
    return argv


def score_bwrap_argv(
    policy: JailPolicy, paths: JailPaths, scorer: str, data: str | None, env: Sequence[str], command: str
) -> list[str]:
    """The score stage's bwrap: like a job's, but never with network, the side's tree read-only (it reads what
    `command` wrote, it cannot change it), the scorer read-only, the private data read-only at a path the wrapper
    draws after `command` has exited (SCORE_DATA_TOKEN: no symlink the candidate planted can point at it), cwd
    in the scorer (so a relative path or `sys.path[0]` never resolves into the candidate's tree), and a home of
    its own. No `/proc` at all: through `/proc/self/fd/N` a path would reach the scorer's own open files (its
    labels), and bwrap cannot mount one with hidepid; the tree it reads is the wrapper's copy of regular files
    and directories only (kernel.node.wrapper.copy_for_scorer)."""
    tree, home, scorer = _abs(paths.tree, "tree"), _abs(paths.home, "home"), _abs(scorer, "scorer")
    argv = _bwrap_start(
        policy, network=False, hostname="syscall-score", bound=(*policy.system_dirs, *policy.etc)
    )
    argv += ["--dev", "/dev", "--tmpfs", "/tmp"]
    argv += _ro_dir_args(policy)
    argv += ["--bind", home, home, "--ro-bind", tree, tree, "--ro-bind", scorer, scorer]
    if data is not None:
        argv += ["--ro-bind", _abs(data, "score data"), SCORE_DATA_TOKEN]
    argv += ["--chdir", scorer]
    argv += list(env)
    argv += ["--", "sh", "-c", command]
    return argv


def build_bwrap_argv(
    policy: JailPolicy,
    *,
    network: bool,
    writable: Sequence[str],
    readable: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    argv: Sequence[str],
    mounts: Sequence[tuple[str, str, bool]] = (),
) -> list[str]:
    """The locked environment's build jail (kernel.io.envcache: `uv sync` and the byte-compilation run in it on
    the kernel's host): every namespace unshared (the network's too unless `network`: uv downloads, compiling
    does not), the system directories, the allowlisted /etc files (and resolv.conf, gai.conf with the network),
    `policy.ro_dirs` and `readable` read-only, `writable` read-write, `mounts` (a host path bound at another
    path of the jail) and nothing else of the host: not the kernel's state, not the run directory around the
    entry being built, not a workspace; a fresh /tmp, /proc and /dev; `env` as the whole environment; `argv`
    run directly (no shell)."""
    bound = [*policy.system_dirs, *policy.etc, *(NETWORK_ETC if network else ())]
    out = _bwrap_start(policy, network=network, hostname="syscall-envbuild", bound=bound)
    out += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    out += _ro_dir_args(policy)
    for d in readable:
        out += ["--ro-bind", _abs(d, "read-only path"), d]
    for d in writable:
        out += ["--bind", _abs(d, "writable path"), d]
    for host, inside, write in mounts:  # (host path, its path in the jail, writable), in order
        out += ["--bind" if write else "--ro-bind", _abs(host, "mounted path"), _abs(inside, "mount point")]
    out += ["--chdir", _abs(cwd, "working directory")]
    out += env_args("bwrap", env)
    out += ["--", *argv]
    return out


def sync_argv(uv: str, project: str, python: str, *, offline: bool) -> list[str]:
    """`uv sync` as the kernel's warm-up (kernel.io.envcache) runs it: the frozen
    lock, wheels only, never the project itself, no configuration file."""
    argv = [uv, "sync", "--frozen", "--no-build", "--no-install-project", "--no-config", "--project", project]
    argv += ["--python", python]
    if offline:
        argv.append("--offline")
    return argv


def listing_bwrap_argv(
    policy: JailPolicy,
    *,
    workspace: str,
    workspace_fd: int,
    readable: Sequence[str],
    env: Mapping[str, str],
    info_fd: int,
    argv: Sequence[str],
) -> list[str]:
    """The jail of a snapshot's git listing (kernel.io.gitlisting) on the kernel's host, where git walks the
    agent's live tree and parses its index copy and `.gitignore` files: every namespace unshared, the network's
    too; the system directories and the allowlisted /etc files read-only; the workspace read-only at its own path,
    bound from `workspace_fd` (the directory the kernel opened, so a workspace path swapped for a link meanwhile
    binds nothing else); `readable` (the kernel's scratch git directory) read-only; a fresh /dev (git reads
    /dev/null as its global config); no /proc, no /tmp, the jail's root read-only, and nothing else of the host:
    not the kernel's state, not the run directory, not another workspace. `argv` runs as pid 1 of its namespace
    (`--as-pid-1`), so the host pid bwrap writes to `info_fd` (`child-pid`) is the listing process itself, the one
    the kernel watches and kills (the namespace goes with it); `env` is its whole environment."""
    ws = _abs(workspace, "workspace")
    out = _bwrap_start(
        policy, network=False, hostname="syscall-listing", bound=(*policy.system_dirs, *policy.etc)
    )
    out += ["--as-pid-1", "--info-fd", str(info_fd), "--dev", "/dev"]
    out += ["--ro-bind-fd", str(workspace_fd), ws]
    for d in readable:
        out += ["--ro-bind", _abs(d, "read-only path"), d]
    out += ["--remount-ro", "/", "--chdir", ws]
    out += env_args("bwrap", env)
    out += ["--", *argv]
    return out


def score_apptainer_argv(
    policy: JailPolicy, paths: JailPaths, scorer: str, data: str | None, env: Sequence[str], command: str
) -> list[str]:
    if not policy.image:
        raise ValueError("jail 'apptainer' needs an image (jail.image in the kernel config)")
    tree, home, work = _abs(paths.tree, "tree"), _abs(paths.home, "home"), _abs(paths.work, "work")
    argv = [policy.apptainer, "exec", "--containall", "--cleanenv", "--net", "--network", "none"]
    argv += ["--bind", f"{tree}:{tree}:ro", "--bind", f"{_abs(scorer, 'scorer')}:{scorer}:ro"]
    for d in policy.ro_dirs:
        argv += ["--bind", f"{_abs(d, 'read-only directory')}:{d}:ro"]
    if data is not None:
        argv += ["--bind", f"{_abs(data, 'score data')}:{SCORE_DATA_TOKEN}:ro"]
    argv += ["--pwd", scorer, "--home", home, "--workdir", work]
    argv += list(env)
    argv += [policy.image, "sh", "-c", command]
    return argv


def score_template_argv(policy: JailPolicy, *, data: str | None) -> list[str]:
    """The score stage's argv with node-side tokens (the tree, its home and the scorer directory live in the
    node's scratch); `data` is the operator's directory, the same path on every node."""
    match policy.kind:
        case "bwrap":
            return score_bwrap_argv(policy, TEMPLATE_PATHS, SCORER_TOKEN, data, [ENV_TOKEN], COMMAND_TOKEN)
        case "apptainer":
            return score_apptainer_argv(
                policy, TEMPLATE_PATHS, SCORER_TOKEN, data, [ENV_TOKEN], COMMAND_TOKEN
            )
        case "none":
            return none_argv(COMMAND_TOKEN)


def build_argv(
    policy: JailPolicy,
    paths: JailPaths,
    env: Sequence[str],
    command: str,
    *,
    gpus: int = 0,
    venv: str | None = None,
    venv_source: str | None = None,
    gpu_args: Sequence[str] = (),
) -> list[str]:
    match policy.kind:
        case "bwrap":
            return bwrap_argv(
                policy, paths, env, command, venv=venv, venv_source=venv_source, gpus=gpus, gpu_args=gpu_args
            )
        case "apptainer":
            return apptainer_argv(policy, paths, env, command, gpus=gpus, venv=venv, venv_source=venv_source)
        case "none":
            return none_argv(command)


def template_argv(policy: JailPolicy, *, gpus: int = 0) -> list[str]:
    """The argv with node-side tokens, for the job wrapper to fill in."""
    return build_argv(
        policy,
        TEMPLATE_PATHS,
        [ENV_TOKEN],
        COMMAND_TOKEN,
        gpus=gpus,
        venv=VENV_TOKEN if policy.venv else None,
        venv_source=VENV_SOURCE_TOKEN if policy.venv else None,
        gpu_args=[GPU_TOKEN],
    )


def gpu_bind_args(visible: str | None, present: Sequence[str], *, constrained: bool) -> list[str]:
    """bwrap arguments binding the GPU device nodes of a task (pure; kernel.node.wrapper keeps a stdlib copy that a
    unit test holds equal to this one).

    `present` lists the names under /dev (e.g. `nvidia0`, `nvidiactl`, `dri/renderD128`). The task gets the
    `/dev/nvidia<N>` named by `visible` (CUDA_VISIBLE_DEVICES: indices), or every one present when the scheduler
    confines devices by cgroup (`constrained`: Slurm's ConstrainDevices makes the others unopenable and renumbers
    CUDA_VISIBLE_DEVICES) or when `visible` is unset or names GPUs by UUID; plus the control nodes and render
    nodes that exist. A task with no GPU gets none of this (the caller does not call it)."""
    cards = sorted((n for n in present if re.fullmatch(r"nvidia[0-9]+", n)), key=lambda n: int(n[6:]))
    wanted = cards
    if not constrained and visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in ids):
            wanted = [n for n in cards if n[6:] in {str(int(v)) for v in ids}]
    out: list[str] = []
    names = [*wanted, *(n for n in GPU_CONTROL if n in present)]
    names += sorted(n for n in present if re.fullmatch(r"dri/renderD[0-9]+", n))
    for n in names:
        out += ["--dev-bind-try", f"/dev/{n}", f"/dev/{n}"]
    return out
