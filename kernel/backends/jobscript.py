"""The one writer of a launch's `command.txt` and `job.sh`, and the kernel-side reader of what the wrapper wrote.

`job.sh` is `kernel/node/wrapper.py` (stdlib Python 3.8+, so sbatch runs it as is) with the launch's configuration
embedded as a JSON literal; every backend runs the same file. The layout it writes per task is `RunPaths`'; the
`exit-code` file is one JSON object (`ExitRecord`), written last and atomically. A backend that finds a wrapper
gone without an `exit-code` (SIGKILL after the grace, a lost node) writes one itself through `write_exit`, so
every finished task has exactly one explanation.

Materialisation reads the snapshot straight from the objects of the kernel's repository of the workspace
(`<run_dir>/repos/<key>.git`, kernel.io.repo; `ls-tree` + `cat-file --batch`, every blob re-hashed and the
tree id recomputed) rather than `git worktree add` or `git archive`: nothing the workspace chose runs, its
`.git` is neither read nor written on the node, and no `.git` is left in the job's tree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Final

import msgspec

from channel import sweep
from channel.paths import RunPaths
from kernel.backends.base import JobSpec
from kernel.io.repo import neutral_env
from kernel.node import jail as J
from kernel.node import wrapper as W

WRAPPER_SOURCE: Final = Path(W.__file__)
# RunPaths' file names are dataclass fields (slots), so they are read from an instance, not the class.
NAMES: Final = RunPaths(Path("/"), "-", 0, "-")
CONFIG_LINE: Final = "CONFIG_JSON: str | None = None  # @@SYSCALL_CONFIG@@"

# Exit codes: the command's own status, 128+N for a signal, or these (exit-code's `kind` disambiguates).
EXIT_DISK_FULL: Final = W.EXIT_DISK_FULL  # the run directory's disk was full (ENOSPC, EDQUOT)
KIND_DISK_FULL: Final = W.KIND_DISK_FULL
EXIT_DISK_LIMIT: Final = W.EXIT_DISK_LIMIT  # the job's tree went over its `tree_mb` limit
EXIT_EMPTY_COMMAND: Final = W.EXIT_EMPTY_COMMAND  # command.txt empty or blank
EXIT_MATERIALISE_FAILED: Final = W.EXIT_MATERIALISE_FAILED  # the snapshot could not be written to scratch
EXIT_TERMINATED: Final = W.EXIT_TERMINATED  # SIGTERM/SIGINT/SIGHUP: cancel or the scheduler
EXIT_TIMEOUT: Final = W.EXIT_TIMEOUT  # SIGUSR2: the walltime (Slurm's --signal=B:USR2, the local backend)
EXIT_WRAPPER_ERROR: Final = W.EXIT_WRAPPER_ERROR  # bad configuration, bad task index, jail would not start
EXIT_LOST: Final = 125  # the wrapper vanished without writing exit-code (written by the backend)

ExitKind = str  # one of W.KIND_* or KIND_LOST / KIND_CANCELLED
KIND_LOST: Final = "lost"
KIND_CANCELLED: Final = "cancelled"  # cancelled before it ever started (written by the backend)


class UnseenPath(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A path of the job's tree the score stage's copy left out (kernel.node.wrapper.copy_for_scorer)."""

    path: str
    why: str


class ExitRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    code: int
    kind: ExitKind
    signal: str | None = None
    command_code: int | None = None
    score_code: int | None = None  # the operator's score stage (submit), when it ran
    score_unseen: tuple[UnseenPath, ...] = ()  # the first paths the score stage's copy left out
    score_unseen_count: int = 0  # how many it left out in all
    finished_at: str | None = None
    host: str | None = None
    detail: str | None = None


class ArtifactRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    status: str  # "copied" | "skipped"
    size: int | None = None
    sha256: str | None = None
    reason: str | None = None


def wrapper_config(spec: JobSpec) -> dict[str, object]:
    """The configuration `job.sh` embeds (pure)."""
    paths = spec.paths
    env = J.jail_env(
        home=J.HOME_TOKEN,
        venv=J.VENV_TOKEN if spec.environment is not None else None,
        path_dirs=spec.path_dirs,
    )
    env |= job_variables(spec)
    # The run directory, the live workspace and a submit's private score data are never bound (the data only in
    # the score stage's own jail); should an operator place them below a bound system directory, they are masked.
    private = (spec.score.data,) if spec.score is not None and spec.score.data is not None else ()
    hide = tuple(dict.fromkeys((*spec.jail.hide, spec.run_dir, spec.workspace_path, *private)))
    ro_dirs = spec.jail.ro_dirs
    if spec.environment is not None and spec.environment.python_install_dir:
        ro_dirs = (*ro_dirs, spec.environment.python_install_dir)
    jail = msgspec.structs.replace(spec.jail, hide=hide, venv=spec.environment is not None, ro_dirs=ro_dirs)
    return {
        "version": 1,
        "key": spec.key,
        "launch_dir": str(paths.launch_dir),
        "array": spec.array,
        "git": {
            "repo": str(spec.repo_path),
            "commit": spec.commit,
            "tree": spec.tree,
            "env": neutral_env(str(spec.repo_path)),
            "protected": None
            if spec.base_files is None
            else {
                "commit": spec.base_files.commit,
                "tree": spec.base_files.tree,
                "patterns": list(spec.base_files.patterns),
            },
        },
        "seeds": list(spec.eval_seeds),
        "seed_to_command": spec.seeds_to_command,
        "score": None if spec.score is None else _score_config(spec, jail),
        "jail": {"kind": spec.jail.kind, "argv": J.template_argv(jail, gpus=spec.gpus)},
        "env": env,
        "index_vars": [*J.INDEX_VARS, J.TASK_VAR],
        # A swept launch: task i's own variables (SWEEP_<KEY>, SWEEP_PARAMS), by index.
        "sweep": [sweep.variables(p) for p in spec.params],
        # A task without GPUs gets neither device nodes nor the node's GPU list.
        "forward_vars": list(J.FORWARD_VARS) if spec.gpus > 0 else [],
        "gpu": {"count": spec.gpus, "constrained": spec.gpus_constrained},
        "limits": {
            "mem_mb": spec.jail.mem_mb,
            "max_procs": spec.jail.max_procs,
            "tree_mb": spec.jail.tree_mb,
            "cpus": spec.jail.cpus,
        },
        "environment": None
        if spec.environment is None
        else dict(
            msgspec.to_builtins(spec.environment),
            mount=J.SHARED_VENV,  # where a bwrap or apptainer jail binds the cache entry's venv (`venv`)
        ),
        "artifacts": list(spec.artifacts),
        "artifact_max_bytes": spec.artifact_max_bytes,
        "artifact_total_max_bytes": spec.artifact_total_max_bytes,
        "output_max_bytes": spec.output_max_bytes,
        "scratch": spec.scratch,
        "kill_grace_s": spec.kill_grace_s,
    }


def _score_config(spec: JobSpec, jail: J.JailPolicy) -> dict[str, object]:
    score = spec.score
    assert score is not None
    # In a real jail the data is mounted at a path the wrapper draws after `command` has exited (see run_score);
    # without one the scorer reads it where it is.
    data = None if score.data is None else score.data if jail.kind == "none" else J.SCORE_DATA_TOKEN
    env = J.score_env(home=J.HOME_TOKEN, tree=J.TREE_TOKEN, scorer=J.SCORER_TOKEN, data=data)
    scorer = None
    if score.scorer_commit is not None:
        scorer = {"commit": score.scorer_commit, "tree": score.scorer_tree}
    return {
        "command": score.command,
        "kind": jail.kind,
        "argv": J.score_template_argv(jail, data=score.data),
        "env": env,
        "scorer": scorer,
    }


def job_variables(spec: JobSpec) -> dict[str, str]:
    """The variables naming the job, the same in every task (the index variables are set per task)."""
    return {
        J.LAUNCH_VAR: spec.launch,
        J.SLEEP_VAR: spec.sleep_id or str(spec.seq),
        J.SNAPSHOT_VAR: spec.commit,
    }


def render_job_script(spec: JobSpec, source: str | None = None) -> str:
    """`kernel/node/wrapper.py` with the launch's configuration embedded (pure apart from reading the template)."""
    text = WRAPPER_SOURCE.read_text() if source is None else source
    if text.count(CONFIG_LINE) != 1:
        raise RuntimeError(f"{WRAPPER_SOURCE}: expected exactly one configuration marker line")
    literal = json.dumps(wrapper_config(spec), sort_keys=True)
    return text.replace(CONFIG_LINE, f"CONFIG_JSON: str | None = {literal!r}")


def write_atomic(directory: Path, name: str, data: bytes, mode: int) -> None:
    """Write `directory/name` durably and whole (a temp file fsynced, then renamed over it) with `mode`; a failed
    write (a full disk) leaves no temp file."""
    W.write_atomic(os.fspath(directory), name, data, mode)


def write_launch(spec: JobSpec) -> Path:
    """Create the launch directory with `command.txt` and `job.sh` (idempotent); returns job.sh's path."""
    launch_dir = spec.paths.launch_dir
    launch_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(launch_dir, NAMES.COMMAND, spec.command.encode(), 0o600)
    write_atomic(launch_dir, NAMES.JOB_SCRIPT, render_job_script(spec).encode(), 0o700)
    return launch_dir / NAMES.JOB_SCRIPT


def read_exit(task_dir: Path) -> ExitRecord | None:
    """The task's exit record, or None while it has none. A record that cannot be read or decoded (cut short, an
    I/O error) is an end too: a wrapper failure saying so, never an exception."""
    try:
        data = (task_dir / NAMES.EXIT_CODE).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return unreadable_exit(f"the exit-code record could not be read: {e}")
    try:
        return msgspec.json.decode(data, type=ExitRecord)
    except msgspec.DecodeError as e:
        return unreadable_exit(f"the exit-code record is not valid ({len(data)} bytes): {e}")


def held_record(record: ExitRecord, error: OSError) -> ExitRecord:
    """The end a backend keeps in memory for a task whose exit record it could not write (`error`). On a full
    disk: a task gone without a record, or one that never started (`lost`, `wrapper_error`), is `disk_full` (the
    full disk is what the record would have said, or what stopped it); any other end (a walltime, a cancel,
    Slurm's own account) stays, its detail saying the record could not be written."""
    if error.errno not in W.DISK_ERRNOS:
        return record
    why = record.detail or record.kind
    if record.kind in (KIND_LOST, W.KIND_WRAPPER):
        return ExitRecord(
            EXIT_DISK_FULL,
            W.KIND_DISK_FULL,
            detail=f"the run directory's disk is full: the task's exit record ({why}) could not be written",
        )
    return msgspec.structs.replace(
        record, detail=f"{why}; its exit record could not be written: the run directory's disk is full"
    )


def unreadable_exit(detail: str) -> ExitRecord:
    return ExitRecord(EXIT_WRAPPER_ERROR, W.KIND_WRAPPER, detail=detail)


def write_exit(task_dir: Path, record: ExitRecord) -> None:
    """Write an exit record on the wrapper's behalf (it died without one, or never started), into the room the
    wrapper reserved for it when there is one (so a full disk does not stop it). Raises OSError (ENOSPC) when
    it cannot be written; the caller decides what that end is."""
    task_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    W.write_record(os.fspath(task_dir), NAMES.EXIT_CODE, msgspec.json.encode(record) + b"\n", 0o644)


def read_timestamp(task_dir: Path, name: str) -> datetime | None:
    """`started` or `ended` as an aware datetime, or None when absent."""
    try:
        text = (task_dir / name).read_text().strip()
    except FileNotFoundError:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def read_artifact_log(task_dir: Path) -> list[ArtifactRecord]:
    try:
        lines = (task_dir / NAMES.ARTIFACTS_LOG).read_bytes().splitlines()
    except FileNotFoundError:
        return []
    return [msgspec.json.decode(line, type=ArtifactRecord) for line in lines if line.strip()]


def wrapper_env(
    base: Mapping[str, str], *, task: int, tmpdir: str | None = None, detach_cleanup: bool = False
) -> dict[str, str]:
    """The environment a backend starts `job.sh` with: nothing of the kernel's own (secrets stay out).
    `detach_cleanup`: the wrapper leaves once exit-code is written, a detached child removing the task's scratch
    (a backend whose slot is the wrapper's process and that leaves a job's stray processes alone)."""
    env = {"PATH": base.get("PATH", J.JAIL_PATH), "LANG": "C.UTF-8", "SWEEP_INDEX": str(task)}
    if detach_cleanup:
        env[W.DETACH_VAR] = "1"
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    for name in J.FORWARD_VARS:
        if name in base:
            env[name] = base[name]
    return env
