"""What every backend is given and must do: the JobSpec, the Backend protocol and the errors it may raise.

A JobSpec describes one launch of one sleep (a single job or an array) completely: where its run directory is,
which snapshot it runs, how it is jailed, and its resources. `kernel.backends.jobscript` turns it into the launch's
`command.txt` and `job.sh`; a backend only decides where and when `job.sh` runs (a local child process, or an
sbatch job) and how to stop it. Completion is always read from the wrapper's `exit-code` files.

The contract (`Backend`), in the order the service uses it:
1. `recover(run_dir)` once at start, BEFORE `run`: adopt what the run directories record (needs no loop);
2. `run()` in the service's task group for as long as the kernel serves (`RunnableBackend`);
3. `submit(spec)` per launch (idempotent per `spec.key`), `cancel(key, tasks)` when asked;
4. `wait_any_exit()` for each task's end (its `exit-code` record in place);
5. `outcome_of(task_dir)` and `hint_of(task_dir)` read a finished task's end: its state, exit code and signal
   (kernel.core.exits.outcome, the one table, with what the scheduler said where the backend has it) and the
   backend's own explanation for the wake.
`submit` and `cancel` raise only the typed errors below for a failure that is not a kernel bug: a
`BackendRefused` is the agent's (the sleep is rejected `backend.refused` and refunded, never retried), a
`BackendUnavailable` is the world's (the sleep stays unanswered and is retried later, backing off per
workspace). The executor decides by these types, never by an exception's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Final, Literal, Protocol

import msgspec
from anyio.abc import TaskStatus as StartedStatus
from msgspec import Meta

from channel import limits as L
from channel.paths import RunPaths
from kernel.backends.slurm.submit import job_name as scheduler_job_name
from kernel.core.exits import Outcome
from kernel.node.jail import JailPolicy, JobEnvironment

DEFAULT_ARTIFACT_MAX_BYTES: Final = 64 * 1024 * 1024
DEFAULT_ARTIFACT_TOTAL_MAX_BYTES: Final = 256 * 1024 * 1024
DEFAULT_OUTPUT_MAX_BYTES: Final = 64 * 1024 * 1024


class BaseFiles(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Protected paths of a submit's evaluation run: on the node, every path of the run's tree under one of
    `patterns` is taken from this commit (the workspace's submit base) instead of the run's own commit."""

    commit: str
    tree: str
    patterns: tuple[str, ...]


class ScoreStage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The operator's `score` command, run on the node after the run's command has exited, in a jail of its own
    (kernel.node.jail.score_template_argv): the tree read-only, `data` read-only, the scorer directory as cwd, which
    is the base commit's tree when `scorer_commit` is set and an empty directory otherwise."""

    command: str
    data: str | None = None
    scorer_commit: str | None = None
    scorer_tree: str | None = None


class JobSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One launch of one sleep, as every backend runs it."""

    workspace: str  # the workspace key (channel.paths.workspace_key)
    workspace_path: str  # the resolved workspace directory (never read by the job: it runs the snapshot)
    seq: int
    launch: Annotated[str, Meta(pattern=L.NAME_PATTERN)]
    run_dir: str
    command: str
    commit: str
    tree: str
    minutes: Annotated[int, Meta(ge=L.MINUTES_MIN, le=L.MINUTES_CEILING)]
    array: Annotated[int, Meta(ge=1, le=L.ARRAY_MAX)] = 1
    concurrency: Annotated[int, Meta(ge=0, le=L.ARRAY_MAX)] = 0  # 0 = the whole array at once
    gpus: Annotated[int, Meta(ge=0, le=L.GPUS_CEILING)] = 0
    # What the launch asked for per task (None: the backend's default). The Slurm backend asks the scheduler for
    # them; the local backend's wrapper enforces them from `jail` (dispatch puts them there).
    mem_mb: Annotated[int, Meta(ge=L.MEM_MB_MIN, le=L.MEM_MB_CEILING)] | None = None
    cpus: Annotated[int, Meta(ge=1, le=L.CPUS_CEILING)] | None = None
    artifacts: tuple[str, ...] = ()
    # A swept launch: task i's values of the sweep's keys (its SWEEP_<KEY> and SWEEP_PARAMS); empty without one.
    params: tuple[tuple[tuple[str, str], ...], ...] = ()
    jail: JailPolicy = JailPolicy()
    # A submit's evaluation run: task i gets seed i as EVAL_SEED (the command only when `seeds_to_command`;
    # the score stage always), protected files from the base, and the operator's score stage.
    eval_seeds: tuple[int, ...] = ()
    seeds_to_command: bool = True
    base_files: BaseFiles | None = None
    score: ScoreStage | None = None
    scratch: str | None = None  # node scratch base; None = the node's TMPDIR or /tmp
    artifact_max_bytes: int = DEFAULT_ARTIFACT_MAX_BYTES
    artifact_total_max_bytes: int = DEFAULT_ARTIFACT_TOTAL_MAX_BYTES
    output_max_bytes: int = DEFAULT_OUTPUT_MAX_BYTES  # per stream (stdout, stderr) of each task
    kill_grace_s: float = 5.0
    environment: JobEnvironment | None = None  # the locked environment each task builds (kernel.io.envcache)
    # The scheduler confines devices by cgroup (Slurm's ConstrainDevices): bind every GPU node present.
    gpus_constrained: bool = False
    path_dirs: tuple[str, ...] = ()  # put on the job's PATH before the system's (environment.extra_dirs)
    sleep_id: str = ""  # SYSCALL_SLEEP in the job's environment; the Slurm backend's `--comment` too
    # The workspace's own Slurm account (`enroll --account`; None: the site's `[slurm] account`); the other
    # backends ignore it.
    account: str | None = None

    @property
    def paths(self) -> RunPaths:
        return RunPaths(Path(self.run_dir), self.workspace, self.seq, self.launch)

    @property
    def repo_path(self) -> Path:
        """The kernel's repository of the workspace, which holds `tree` (the job materialises from it)."""
        return RunPaths.repo_of(Path(self.run_dir), self.workspace)

    @property
    def key(self) -> str:
        """Unique per launch across the kernel: `<workspace>/<seq>/<launch>`."""
        return f"{self.workspace}/{self.seq}/{self.launch}"

    @property
    def job_name(self) -> str:
        """The scheduler-visible name (`sk-<workspace>-<seq>-<launch>`, kernel.backends.slurm.job_name); it carries the
        sleep so a restarted kernel can look before resubmitting."""
        return scheduler_job_name(self.workspace, self.seq, self.launch)

    @property
    def width(self) -> int:
        """How many tasks may run at once."""
        return self.array if self.concurrency == 0 else min(self.concurrency, self.array)

    def task_dir(self, task: int) -> Path:
        return self.paths.task_dir(task, self.array)


class BackendError(Exception):
    """A backend could not do what it was asked; the subclass says whose fault it is."""


class BackendUnavailable(BackendError):
    """The world's fault: the scheduler cannot be reached or stays busy through every retry, or the run
    directory cannot be written (disk full, I/O error). Nothing is wrong with the launch: the executor answers
    nothing now (`ExecutorUnavailable`) and the sleep is tried again later."""


class BackendRefused(BackendError):
    """The agent's: the backend refuses this launch for good (Slurm: an invalid partition, account, QOS or GRES
    request), so the same launch fails the same way every time. The sleep is rejected with `backend.refused`
    and refunded, never retried. `detail` is the backend's own reason, shown to the agent."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


TaskStatus = Literal["pending", "running", "finished"]


class TaskRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: str  # JobSpec.key
    task: int
    job_id: str


class TaskExit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A task's wrapper is gone and its exit-code file is in place (read it with kernel.backends.jobscript.read_exit)."""

    key: str
    task: int
    task_dir: str


class Recovered(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a restarted backend found in the run directories."""

    running: tuple[TaskRef, ...]
    finished: tuple[TaskRef, ...]
    requeued: tuple[TaskRef, ...]  # recorded but never started: queued again
    lost: tuple[TaskRef, ...]  # started, gone without an exit-code: one was written saying so


class Backend(Protocol):
    """Runs job wrappers. Non-blocking methods are sync; waiting ones are async and named wait_*."""

    name: str

    async def submit(self, spec: JobSpec) -> list[TaskRef]:
        """Queue every task of the launch (job.sh must already be written); idempotent per spec.key.
        Raises `BackendRefused` (the agent's fault) or `BackendUnavailable` (the world's)."""
        ...

    async def cancel(self, key: str, tasks: Sequence[int] | None = None) -> list[TaskRef]:
        """Stop the launch's tasks (all when `tasks` is None); returns those that had not finished.
        Raises `BackendUnavailable` when it cannot act now (the cancel is tried again later)."""
        ...

    async def recover(self, run_dir: Path) -> Recovered:
        """Rebuild what is running and what finished from the run directories after a restart.

        The order is fixed: the service calls `recover` BEFORE `run` (a restart learns what exists before it
        serves). So `recover` needs no running loop: work it finds (a launch to submit again) is queued and
        started by `run`."""
        ...

    async def wait_any_exit(self) -> TaskExit:
        """The next task to finish (its exit-code file is in place)."""
        ...

    def outcome_of(self, task_dir: Path) -> Outcome | None:
        """How a finished task ended (its lifecycle event, state, exit code, signal, hint), from its recorded exit
        through kernel.core.exits.outcome; None while it has no exit record. Pure apart from reading the task's
        kernel-owned files."""
        ...

    def hint_of(self, task_dir: Path) -> str | None:
        """The backend's own explanation of how a finished task ended, for the wake, when it has one (pure
        apart from reading the task's kernel-owned files); None defers to the exit kind's hint."""
        ...


class RunnableBackend(Backend, Protocol):
    """A backend with its service loop (`run`), started in the service's task group."""

    async def run(self, *, task_status: StartedStatus[None] = ...) -> None: ...

    def degraded(self) -> str | None:
        """Why the backend cannot do its work now (its scheduler unreachable, since when), for the kernel's
        status line; None while it can."""
        ...
