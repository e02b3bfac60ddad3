"""The kernel's configuration: one TOML file decoded into strict, frozen msgspec Structs.

Unknown keys, wrong types and out-of-range values are refused with the file and the dotted key named, so a typo
never silently falls back to a default. Relative paths are resolved against the config file's directory.
`state_dir` defaults to `$XDG_STATE_HOME/syscall-kernel`, else `~/.local/state/syscall-kernel`, for the service and
the CLI alike.
"""

from __future__ import annotations

import os
import pwd
import re
import tomllib
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta, Struct

from channel import limits as L
from channel.messages import VERBS, EvalContract, Policy, Verb, VerdictRules
from kernel.core.evaluate import contract_problem
from kernel.core.statepaths import StatePaths

ENV_CONFIG: Final = "SYSCALL_KERNEL_CONFIG"
CONFIG_DIR: Final = Path("/etc/syscall-kernel")

WatchMode = Literal["auto", "inotify", "poll"]


class ConfigError(Exception):
    """Bad configuration: the message names the file and the key."""


class _Strict(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class Defaults(_Strict, frozen=True, kw_only=True):
    """Budgets and policy given to a workspace at enrollment (the `enroll` flags override the budgets)."""

    launches: Annotated[int, Meta(ge=0, le=10**9)] = L.BUDGET_LAUNCHES
    sleeps: Annotated[int, Meta(ge=0, le=10**9)] = L.BUDGET_SLEEPS
    gpu_hours: Annotated[float, Meta(ge=0, le=10**7)] = L.BUDGET_GPU_HOURS
    max_minutes: Annotated[int, Meta(ge=L.MINUTES_MIN, le=L.MINUTES_CEILING)] = L.POLICY_MAX_MINUTES
    max_gpus: Annotated[int, Meta(ge=0, le=L.GPUS_CEILING)] = L.POLICY_MAX_GPUS
    max_concurrent_gpus: Annotated[int, Meta(ge=0, le=L.GPUS_CEILING * L.ARRAY_MAX)] = L.POLICY_MAX_GPUS
    # The most memory (MB) and CPUs per task a launch may ask for (`launch --mem`, `--cpus`); a launch that asks
    # for none gets the backend's default ([slurm] mem_mb and cpus_per_task, [local] mem_mb).
    max_mem_mb: Annotated[int, Meta(ge=L.MEM_MB_MIN, le=L.MEM_MB_CEILING)] = L.POLICY_MAX_MEM_MB
    max_cpus: Annotated[int, Meta(ge=1, le=L.CPUS_CEILING)] = L.POLICY_MAX_CPUS
    network: bool = False
    submit: EvalContract | None = None
    # the verbs a workspace may use (policy.verb_disabled for the others); e.g. withhold `queue`, which shows
    # other workspaces' jobs
    verbs: tuple[Verb, ...] = VERBS
    # Set as `[defaults.submit] share_baselines` (see `parse`). Off: a measured baseline is reused only by the
    # workspace that measured it. On: by any workspace whose base tree (as the kernel's repository computed it)
    # and evaluation setup are the same; one workspace's measurement is then another's, so a fault or a
    # nondeterministic eval in one is inherited by the others.
    share_baselines: bool = False
    # The most sleeps carrying a submit a workspace may have accepted in any 24 hours (0: no bound); each submit's
    # verdict tells the agent something about the private data, however it is disclosed.
    max_submits_per_day: Annotated[int, Meta(ge=0, le=10**6)] = 0
    # The most sleeps a workspace may have in flight at once (accepted, not yet woken).
    max_sleeps_in_flight: Annotated[int, Meta(ge=1, le=L.SLEEPS_IN_FLIGHT_CEILING)] = (
        L.POLICY_MAX_SLEEPS_IN_FLIGHT
    )

    def policy(self) -> Policy:
        return Policy(
            max_minutes=self.max_minutes,
            max_gpus=self.max_gpus,
            max_concurrent_gpus=self.max_concurrent_gpus,
            max_mem_mb=self.max_mem_mb,
            max_cpus=self.max_cpus,
            network=self.network,
            submit=self.submit,
            verbs=self.verbs,
            max_submits_per_day=self.max_submits_per_day,
            max_sleeps_in_flight=self.max_sleeps_in_flight,
        )


# Names Slurm accepts for a partition (comma-separated alternatives), account, QOS or GPU type.
_SLURM_WORD: Final = r"^[A-Za-z0-9_.+-]+(?:,[A-Za-z0-9_.+-]+)*$"
SlurmWord = Annotated[str, Meta(pattern=_SLURM_WORD)]
_SLURM_ACCOUNT: Final = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


def slurm_account_ok(name: str) -> bool:
    """A single Slurm account name (a workspace's own, `enroll --account`): no alternatives, no spaces."""
    return _SLURM_ACCOUNT.match(name) is not None


class SlurmConfig(_Strict, frozen=True, kw_only=True):
    """Site settings for the Slurm backend (kernel.service.factory.make_backend maps them; docs/operator.md lists them)."""

    partition: SlurmWord | None = None
    account: SlurmWord | None = None
    qos: SlurmWord | None = None
    constraint: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:+\-&|,*\[\]()!]+$")] | None = None
    extra_args: tuple[Annotated[str, Meta(pattern=r"^--[a-z]")], ...] = ()
    # Per task: memory (MB, + mem_per_gpu_mb per GPU) and CPUs (at least cpus_per_gpu per GPU).
    mem_mb: Annotated[int, Meta(ge=1, le=2**31)] = 4096
    mem_per_gpu_mb: Annotated[int, Meta(ge=0, le=2**31)] = 0
    cpus_per_task: Annotated[int, Meta(ge=1, le=4096)] = 1
    cpus_per_gpu: Annotated[int, Meta(ge=0, le=4096)] = 0
    # How GPUs are asked for: `--gres=gpu[:type]:N` or `--gpus-per-task=[type:]N`.
    gpu_flag: Literal["gres", "gpus-per-task"] = "gres"
    gpu_type: SlurmWord | None = None
    nice: Annotated[int, Meta(ge=0, le=2147483645)] | None = None
    # Walltime = the launch's minutes + this (job setup and artifact copy-out).
    setup_slack_minutes: Annotated[int, Meta(ge=1, le=24 * 60)] = 5
    # The batch shell gets SIGUSR2 this long before the walltime (within the slack).
    warn_seconds: Annotated[int, Meta(ge=1, le=65535)] = 120
    # squeue runs at least this far apart right after a change, backing off to poll_max_seconds when quiet.
    poll_seconds: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    poll_max_seconds: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    client_timeout_seconds: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    submit_timeout_seconds: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    submit_attempts: Annotated[int, Meta(ge=1, le=100)] = 6
    exit_grace_seconds: Annotated[float, Meta(ge=0, le=3600)] = 15.0
    file_poll_seconds: Annotated[float, Meta(gt=0, le=600)] = 1.0
    # The site requeues preempted jobs: PREEMPTED is then a wait, not an end.
    requeues: bool = False
    # `--wckey` of every job (Slurm's workload characterization key), e.g. for reports by project.
    wckey: SlurmWord | None = None

    def __post_init__(self) -> None:
        # Raised as msgspec.ValidationError, so `parse` names the `slurm` table.
        if self.poll_max_seconds < self.poll_seconds:
            raise ValueError(
                f"poll_max_seconds ({self.poll_max_seconds:g}) is below poll_seconds ({self.poll_seconds:g})"
            )
        if self.warn_seconds > self.setup_slack_minutes * 60:
            raise ValueError(
                f"warn_seconds ({self.warn_seconds}) is above setup_slack_minutes * 60 "
                f"({self.setup_slack_minutes * 60}): the walltime warning would come while the task still runs "
                "its own minutes"
            )


DEFAULT_TREE_MB: Final = 10240


class LocalConfig(_Strict, frozen=True, kw_only=True):
    """The embedded local backend (used by the execution layer, kernel.service.execute)."""

    # Wrappers running at once across all sleeps; 0 = the number of CPUs.
    max_parallel: Annotated[int, Meta(ge=0, le=4096)] = 0
    # TEST AND DEMO ONLY: how long a declared minute of walltime lasts on this backend.
    seconds_per_minute: Annotated[float, Meta(gt=0, le=60)] = 60.0
    # Per task (kernel.limits): memory (MB), processes, and the size of the jail's /tmp and /dev/shm (MB).
    # 0 = no limit. Slurm jobs keep Slurm's limits.
    mem_mb: Annotated[int, Meta(ge=0, le=2**31)] = 0
    max_procs: Annotated[int, Meta(ge=0, le=2**22)] = 0
    tmp_mb: Annotated[int, Meta(ge=0, le=2**31)] = 0
    # Per task: what a job may put on disk in its tree, home and work directories (MiB; also the largest file it
    # may write). Over it the job is stopped and its task FAILED (`disk_limit`). 0 = no limit.
    tree_mb: Annotated[int, Meta(ge=0, le=2**31)] = DEFAULT_TREE_MB


EnvironmentMode = Literal["uv", "none"]


class EnvironmentConfig(_Strict, frozen=True, kw_only=True):
    """How a job's Python environment is built (kernel.io.envcache): from the snapshot's uv.lock, or the system's."""

    mode: EnvironmentMode = "uv"
    # The interpreter uv builds environments on: an absolute path visible inside the jail (the default is the
    # system's), or a version ("3.12") uv downloads once into the run directory.
    python: Annotated[str, Meta(min_length=1, max_length=4096)] = "/usr/bin/python3"
    # The package index uv downloads from when warming the cache ("" = uv's default, PyPI).
    index_url: Annotated[str, Meta(max_length=4096, pattern=r"^(|https?://\S+)$")] = ""
    # Read-only directories bound into the jail and put on PATH in this order (a site's conda or modules).
    extra_dirs: tuple[Annotated[str, Meta(min_length=1, max_length=4096)], ...] = ()
    # A warm cache unused for this many days is removed.
    keep_days: Annotated[float, Meta(gt=0, le=3650)] = 14.0
    # The longest a cache warm-up may take before its sleeps wake with environment.failed (refunded).
    warm_timeout_seconds: Annotated[float, Meta(gt=0, le=24 * 3600)] = 1800.0
    # Environment builds run at once in the background (each downloads and unpacks a lockfile's wheels); more
    # wait for a slot, their sleeps answered `building` meanwhile.
    max_builds: Annotated[int, Meta(ge=1, le=64)] = 2


class SnapshotLimits(_Strict, frozen=True, kw_only=True):
    """`[snapshot]`: a workspace past any of these is refused (`snapshot.too_large`, no charge) before a single
    file is read: unignored files, their bytes in all, and directory depth (a path of N components is depth N)."""

    max_files: Annotated[int, Meta(ge=1, le=100_000_000)] = L.SNAPSHOT_MAX_FILES
    max_bytes: Annotated[int, Meta(ge=1)] = L.SNAPSHOT_MAX_BYTES
    max_depth: Annotated[int, Meta(ge=1, le=4096)] = L.SNAPSHOT_MAX_DEPTH


class Config(_Strict, frozen=True, kw_only=True):
    state_dir: str = ""
    run_dir: str = ""
    # "none": record and answer sleeps but run nothing (protocol tests, dry runs); tasks stay PENDING.
    backend: Literal["local", "slurm", "none"] = "local"
    jail: Literal["bwrap", "apptainer", "none"] = "bwrap"
    # The image jobs run in with jail = "apptainer".
    apptainer_image: str = ""
    watch: WatchMode = "auto"
    workspaces: tuple[str, ...] = ()
    # The ground truth: every channel is listed this often whatever the watcher says.
    rescan_seconds: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    # How often a polled channel with activity (a request lately, or an answer just given) is looked at: one
    # `stat` of its requests/, and a listing only when that changed (kernel.core.polling).
    poll_seconds: Annotated[float, Meta(gt=0, le=600)] = 0.5
    # A polled channel where nothing happens is looked at less and less often, down to once per this long (or
    # per poll_seconds, if that is longer).
    poll_idle_seconds: Annotated[float, Meta(gt=0, le=3600)] = 4.0
    # Fairness: at most this many requests of one workspace per pass, and this many in all.
    batch_per_workspace: Annotated[int, Meta(ge=1, le=10_000)] = 8
    batch_per_pass: Annotated[int, Meta(ge=1, le=100_000)] = 256
    # A client's `requests/.<id>.tmp` untouched for this long is abandoned and removed (spec 3.1); younger ones
    # may be writes in progress and are never touched.
    temp_grace_minutes: Annotated[float, Meta(ge=1, le=7 * 24 * 60)] = 10.0
    # A store step running longer than this marks the service unhealthy (systemd's watchdog then restarts it).
    stall_seconds: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    # A workspace whose channel I/O (listing, reading, writing answers) has not returned after this long gets a
    # problem in `status`; nothing more is started for it until the I/O returns, and other workspaces go on.
    channel_io_deadline_seconds: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    # The same for a workspace's heavy work (snapshot, artifact copies, wake writes, base imports), which is
    # legitimately long: past this it shows in `status`, gives its slot back, and nothing more heavy starts for it.
    heavy_io_deadline_seconds: Annotated[float, Meta(gt=0, le=86400)] = 300.0
    # The operator's hook for submit verdicts: a command (split like a shell would, run without one) that gets
    # each verdict and its report as JSON on stdin, in state_dir with a clean environment (kernel.service.submitexec).
    on_verdict: str = ""
    on_verdict_timeout_seconds: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    # `serve` as root is refused unless this is true: one kernel per (non-root) user owning the workspaces.
    allow_root: bool = False
    # "text": `event=<name> key=value ...` lines; "json": one JSON object per line (docs/operator.md, Logs).
    log_format: Literal["text", "json"] = "text"
    # The Prometheus endpoint, e.g. "127.0.0.1:9469" ("[::1]:9469"); empty: none (the default).
    metrics_listen: Annotated[str, Meta(pattern=r"^$|^(\[[0-9A-Fa-f:]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")] = ""
    # Each workspace's kernel repository (`<run_dir>/repos/<key>.git`) is packed and pruned this often; released
    # snapshots go then, held bases never.
    repo_gc_hours: Annotated[float, Meta(gt=0, le=24 * 365)] = 24.0
    # Retention (kernel.core.retention): a workspace keeps the evidence (run directories, delivered results,
    # request bodies) of its newest `retention_sleeps` woken sleeps and of every sleep woken within
    # `retention_days`; older ones are pruned. 0 and 0 (the default): everything is kept.
    retention_days: Annotated[float, Meta(ge=0, le=100 * 365)] = 0.0
    retention_sleeps: Annotated[int, Meta(ge=0, le=10**9)] = 0
    # The most a workspace's woken sleeps may hold in `run_dir` (MiB): past it its oldest woken sleeps are pruned,
    # whatever retention_days and retention_sleeps keep (the newest is always kept). 0: no cap.
    retention_run_mb: Annotated[int, Meta(ge=0, le=1 << 40)] = 51200
    # The most of each task's stdout and stderr delivered into results/ (its end, when longer); kernel.json
    # publishes it as limits.log_max_bytes.
    log_max_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = L.LOG_MAX_BYTES
    defaults: Defaults = Defaults()
    # How submits reuse base measurements and what their verdicts disclose (docs/operator.md, "Verdicts").
    verdicts: VerdictRules = VerdictRules()
    snapshot: SnapshotLimits = SnapshotLimits()
    slurm: SlurmConfig = SlurmConfig()
    local: LocalConfig = LocalConfig()
    environment: EnvironmentConfig = EnvironmentConfig()
    # Where this config came from (not a TOML key: filled in by `load`).
    source: str = ""

    @property
    def paths(self) -> StatePaths:
        """The kernel's own directories and files (kernel.core.statepaths)."""
        return StatePaths(Path(self.state_dir), Path(self.run_dir))


def default_task_mem_mb(cfg: Config, gpus: int) -> int | None:
    """The memory limit (MB) of a task of `gpus` GPUs whose launch asks for none: the backend's default ([slurm]
    mem_mb plus mem_per_gpu_mb per GPU, as kernel.backends.slurm.submit asks; [local] mem_mb); None for none."""
    if cfg.backend == "slurm":
        return cfg.slurm.mem_mb + gpus * cfg.slurm.mem_per_gpu_mb
    if cfg.backend == "local" and cfg.local.mem_mb:
        return cfg.local.mem_mb
    return None


class LiveConfig:
    """The running kernel's config: one holder that every component of `serve` shares and reads at each use
    (`.current`, never a Config kept from its construction). A SIGHUP's merged config (kernel.service.reload) is
    set here, in one place, so every reader sees it from then on."""

    __slots__ = ("current",)

    def __init__(self, current: Config) -> None:
        self.current = current

    def use(self, cfg: Config) -> None:
        """Run with `cfg` from now on (a SIGHUP's merged config): every reader sees it at its next use."""
        self.current = cfg


_AT_RE: Final = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_FIELD_RE: Final = re.compile(r"field `(?P<field>[^`]*)`")


def _key_of(path: str, msg: str) -> str:
    key = path.lstrip(".").replace("[", ".").replace("]", "")
    field = _FIELD_RE.search(msg)
    if field and ("unknown field" in msg or "missing required field" in msg):
        key = f"{key}.{field.group('field')}" if key else field.group("field")
    return key


def _friendly(text: str) -> tuple[str, str]:
    m = _AT_RE.match(text)
    assert m is not None
    msg, path = m.group("msg"), m.group("path") or ""
    key = _key_of(path, msg)
    if msg.startswith("Object contains unknown field"):
        return (
            key,
            "is not a known setting (check its spelling; `syscall-kernel example-config` prints an example config, docs/operator.md lists every key)",
        )
    if msg.startswith("Object missing required field"):
        return key, "is required"
    return key, msg[0].lower() + msg[1:] if msg else msg


def parse(text: str, source: str = "<config>", *, env: dict[str, str] | None = None) -> Config:
    """Decode TOML text into a `Config`, resolving paths; ConfigError names `source` and the key."""
    env = dict(os.environ) if env is None else env
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    if "source" in raw:
        raise ConfigError(f"{source}: key 'source' is not a known setting")
    raw = _lift_share_baselines(raw, source)
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        key, why = _friendly(str(exc))
        raise ConfigError(f"{source}: key '{key}' {why}") from None
    return _resolve(cfg, source, env)


def _lift_share_baselines(raw: dict[str, object], source: str) -> dict[str, object]:
    """`[defaults.submit] share_baselines` is the kernel's setting, not part of the contract agents read: it moves
    to `Defaults.share_baselines` (a table holding only it means no default contract)."""
    defaults = raw.get("defaults")
    if not isinstance(defaults, dict):
        return raw
    if "share_baselines" in defaults:
        raise ConfigError(f"{source}: key 'defaults.share_baselines' belongs in [defaults.submit]")
    submit = defaults.get("submit")
    if not isinstance(submit, dict) or "share_baselines" not in submit:
        return raw
    share = submit["share_baselines"]
    if not isinstance(share, bool):
        raise ConfigError(f"{source}: key 'defaults.submit.share_baselines' must be true or false")
    rest = {k: v for k, v in submit.items() if k != "share_baselines"}
    lifted = {k: v for k, v in defaults.items() if k != "submit"}
    lifted["share_baselines"] = share
    if rest:
        lifted["submit"] = rest
    return {**raw, "defaults": lifted}


def _resolve(cfg: Config, source: str, env: dict[str, str]) -> Config:
    base = Path(source).resolve().parent if source and not source.startswith("<") else Path.cwd()

    def absolute(value: str) -> str:
        p = Path(os.path.expanduser(value))
        return str(p if p.is_absolute() else base / p)

    if cfg.state_dir:
        state = absolute(cfg.state_dir)
    else:
        # Never systemd's $STATE_DIRECTORY: the CLI run by hand does not have it, and would use another store
        # than the service (the shipped unit and example config name the state dir explicitly instead).
        xdg = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        state = os.path.join(xdg, "syscall-kernel")
    run = absolute(cfg.run_dir) if cfg.run_dir else os.fspath(StatePaths.at(state).run_dir)
    for i, pattern in enumerate(cfg.workspaces):
        if not pattern.strip():
            raise ConfigError(f"{source}: key 'workspaces.{i}' is empty")
    globs = tuple(absolute(p) for p in cfg.workspaces)
    if cfg.defaults.max_gpus > cfg.defaults.max_concurrent_gpus:
        raise ConfigError(
            f"{source}: key 'defaults.max_gpus' ({cfg.defaults.max_gpus}) is above "
            f"'defaults.max_concurrent_gpus' ({cfg.defaults.max_concurrent_gpus}); no launch could ever run"
        )
    if cfg.jail == "apptainer" and not cfg.apptainer_image:
        raise ConfigError(f"{source}: key 'apptainer_image' is required with jail = 'apptainer'")
    if cfg.defaults.submit is not None:
        # The bounds are the Struct's (refused by `convert` above with the key named); this adds what a schema
        # cannot say: a blank command, a metric that is one of the contract's reserved keys.
        problem = contract_problem(cfg.defaults.submit) or score_data_problem(cfg.defaults.submit)
        if problem is not None:
            raise ConfigError(f"{source}: key 'defaults.submit.{problem[0]}': {problem[1]}")
    envcfg = cfg.environment
    for i, d in enumerate(envcfg.extra_dirs):
        if not d.startswith("/") or ":" in d:
            raise ConfigError(
                f"{source}: key 'environment.extra_dirs.{i}' must be an absolute path without ':', got {d!r}"
            )
    if envcfg.python.startswith(".") or ("/" in envcfg.python and not envcfg.python.startswith("/")):
        raise ConfigError(
            f"{source}: key 'environment.python' must be an absolute path or a version such as '3.12', "
            f"got {envcfg.python!r}"
        )
    if cfg.batch_per_workspace > cfg.batch_per_pass:
        raise ConfigError(f"{source}: key 'batch_per_workspace' is above 'batch_per_pass'")
    return msgspec.structs.replace(cfg, state_dir=state, run_dir=run, workspaces=globs, source=source)


def default_config_paths(user: str | None, config_dir: Path = CONFIG_DIR) -> tuple[Path, ...]:
    """Where a config is looked for without `--config`: the user's own (`<user>.toml`, the file the unit
    syscall-kernel@<user>.service passes, so the CLI run by hand as that user uses the service's store), then
    the site-wide `config.toml`."""
    own = (config_dir / f"{user}.toml",) if user and "/" not in user and not user.startswith(".") else ()
    return (*own, config_dir / "config.toml")


def _user_name() -> str | None:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return None


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    config_dir: Path = CONFIG_DIR,
) -> Config:
    """Load the config from `path`, else `$SYSCALL_KERNEL_CONFIG`, else /etc/syscall-kernel/<user>.toml, else
    /etc/syscall-kernel/config.toml (the first that exists), else the built-in defaults."""
    env = dict(os.environ) if env is None else env
    chosen: Path | None = None
    if path is not None:
        chosen = Path(path)
    elif env.get(ENV_CONFIG):
        chosen = Path(env[ENV_CONFIG])
    else:
        chosen = next((p for p in default_config_paths(_user_name(), config_dir) if p.is_file()), None)
    if chosen is None:
        return parse("", "<defaults>", env=env)
    try:
        text = chosen.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{chosen}: config file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{chosen}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{chosen}: cannot read the config file: {exc.strerror}") from None
    return parse(text, str(chosen), env=env)


def score_data_problem(contract: EvalContract, workspace: str | None = None) -> tuple[str, str] | None:
    """What is wrong with the contract's private score data on this machine, as (field, why): it must be an
    existing directory, and lie outside the workspace (the agent would read it) while not holding it."""
    if contract.score_data is None:
        return None
    data = os.path.realpath(contract.score_data)
    if not os.path.isdir(data):
        return "score_data", f"{contract.score_data!r} is not an existing directory"
    if workspace is not None:
        ws = os.path.realpath(workspace)
        if os.path.commonpath([data, ws]) in (data, ws):
            return "score_data", (
                f"{contract.score_data!r} and the workspace {ws} overlap; private data must lie outside every "
                "workspace (the agent can read its own tree)"
            )
    return None
