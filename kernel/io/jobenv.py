"""`jobenv.json`: what a job of a workspace sees, written into its channel for `syscall env`.

`document` is pure: the config (jail, network, limits, environment mode, interpreter, extra PATH directories),
the workspace's policy and the locked environment of its latest sleep that had a uv.lock. The kernel writes the
file at start and enrollment (`write`), and again after every dispatch that built or reused a locked
environment. What the latest locked environment was is kept outside the channel (which the agent may rewrite)
in `<run_dir>/envs/workspaces/<key>.json`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Final

import msgspec

from channel import limits as L
from channel import safefs
from channel.messages import (
    JOB_VARIABLES,
    JobEnvFile,
    JobLimits,
    JobVariable,
    LockedEnvironment,
    Package,
    Policy,
    SnapshotRules,
    encode,
)
from channel.paths import ChannelPaths
from kernel.core.config import Config
from kernel.io.envcache import WORKSPACES_DIR, EnvReady, index_of
from kernel.io.snapshot import DEFAULT_MAX_FILE_BYTES

SYSTEM_PYTHON: Final = "/usr/bin/python3"

_locked_decoder: Final = msgspec.json.Decoder(LockedEnvironment)


def enforcement(cfg: Config) -> str:
    """What enforces the local backend's per-task limits on this machine (kernel.node.limits decides the same
    way on the node)."""
    if cfg.backend != "local" or not (cfg.local.mem_mb or cfg.local.max_procs):
        return "none"
    return _mechanism()


@functools.cache
def _mechanism() -> str:
    """Probed once per process (a trial cgroup is created and removed), not at every workspace's refresh."""
    from kernel.node import wrapper

    return wrapper.limits_mechanism()


def limits_of(cfg: Config, enforced_by: str) -> JobLimits:
    """The per-task limits jobs get; Slurm's own limits on that backend."""
    if cfg.backend == "slurm":
        return JobLimits(mem_mb=cfg.slurm.mem_mb, enforced_by="scheduler")
    loc = cfg.local
    if not (loc.mem_mb or loc.max_procs or loc.tmp_mb):
        return JobLimits(enforced_by="none")
    return JobLimits(
        mem_mb=loc.mem_mb or None,
        max_procs=loc.max_procs or None,
        tmp_mb=loc.tmp_mb or None,
        enforced_by=enforced_by,  # type: ignore[arg-type]  # one of JobLimits' Literal values
    )


def package_index(cfg: Config | None) -> str | None:
    """The index locked environments install from (published in kernel.json and jobenv.json, so that an agent
    locks against it); None where the kernel builds no environment (`environment.mode = "none"`)."""
    if cfg is None or cfg.environment.mode != "uv":
        return None
    return index_of(cfg.environment.index_url)


def locked_of(ready: EnvReady, built_at: str) -> LockedEnvironment:
    return LockedEnvironment(
        lock_sha256=ready.lock_sha256,
        python_version=ready.python_version,
        packages=tuple(Package(name=n, version=v) for n, v in ready.packages),
        built_at=built_at,
    )


def document(cfg: Config, policy: Policy, locked: LockedEnvironment | None, now: str) -> JobEnvFile:
    """The job environment document as of `now` (its limits say what enforces them here: one answer for every
    writer of the file)."""
    return JobEnvFile(
        protocol=L.PROTOCOL_VERSION,
        backend=cfg.backend,
        jail=cfg.jail,
        network=policy.network,
        environment=cfg.environment.mode,
        python=cfg.environment.python if cfg.environment.mode == "uv" else SYSTEM_PYTHON,
        locked=locked if cfg.environment.mode == "uv" else None,
        max_gpus_per_task=policy.max_gpus,
        limits=limits_of(cfg, enforcement(cfg)),
        path_dirs=cfg.environment.extra_dirs,
        variables=tuple(JobVariable(name=n, meaning=m) for n, m in JOB_VARIABLES),
        snapshot=SnapshotRules(
            max_file_bytes=DEFAULT_MAX_FILE_BYTES,
            max_total_bytes=cfg.snapshot.max_bytes,
            max_files=cfg.snapshot.max_files,
            max_depth=cfg.snapshot.max_depth,
        ),
        updated_at=now,
        package_index=package_index(cfg),
    )


def for_workspace(cfg: Config, key: str, policy: Policy, now: str) -> JobEnvFile:
    """The workspace's document as of now (its latest locked environment from the run directory)."""
    return document(cfg, policy, recall(cfg.paths.envs, key), now)


def _record_path(envs: Path, key: str) -> Path:
    return envs / WORKSPACES_DIR / f"{key}.json"


def remember(envs: Path, key: str, locked: LockedEnvironment | None) -> None:
    """Record the workspace's latest locked environment (None: its latest sleep had no uv.lock) under `envs`
    (StatePaths.envs)."""
    path = _record_path(envs, key)
    if locked is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(locked))
    os.replace(tmp, path)


def recall(envs: Path, key: str) -> LockedEnvironment | None:
    try:
        return _locked_decoder.decode(_record_path(envs, key).read_bytes())
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def write(ch: safefs.Channel, doc: JobEnvFile, *, durable: bool = True) -> None:
    """Write `jobenv.json` unless it already holds exactly this document (apart from its time). `durable=False`:
    the caller syncs the channel's filesystem (safefs.sync_filesystem)."""
    data = encode(doc)
    try:
        current = msgspec.json.decode(
            safefs.read_capped_at(ch.fd, ChannelPaths.JOBENV_JSON, 1 << 20), type=JobEnvFile
        )
        if msgspec.structs.replace(current, updated_at=doc.updated_at) == doc:
            return
    except (safefs.Refused, msgspec.DecodeError, msgspec.ValidationError):
        pass
    ch.write_file(None, ChannelPaths.JOBENV_JSON, data, durable=durable)
