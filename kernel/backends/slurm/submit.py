"""Submission to Slurm as pure functions: the job name, the `sbatch` argv, and the reading of its answer.

The job name `sk-<workspace>-<seq>-<launch>` is unique per launch of a sleep, so a kernel that crashed (or whose
`sbatch` timed out after Slurm had created the job) finds the job by name before it submits again. The argv is a
list for `subprocess` without a shell; the script and every output file live in the kernel-owned run directory,
which Slurm does not create: the caller makes the task directories before it submits.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from msgspec import Meta, Struct

from channel import limits as L
from channel.paths import RunPaths
from kernel.backends.slurm.errors import SlurmOutputError

JOB_NAME_PREFIX: Final = "sk"
# Slurm's default MaxArraySize is 1001 (indices 0-1000); the protocol's own ARRAY_MAX is far below it.
SLURM_ARRAY_MAX: Final = 1001

_WORKSPACE_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_LAUNCH_RE: Final = re.compile(L.NAME_PATTERN)
# A workspace key ends in `-<10 hex>` (channel.paths.workspace_key); that anchors the split of a job name.
_JOB_NAME_RE: Final = re.compile(
    rf"^{JOB_NAME_PREFIX}-(?P<ws>[A-Za-z0-9_-]*?-[0-9a-f]{{10}})-(?P<seq>\d+)-(?P<launch>[a-z0-9][a-z0-9-]{{0,31}})$"
)
# Names Slurm accepts for partitions, accounts, QOS, GPU types; commas separate alternatives (partitions).
_SLURM_WORD_RE: Final = re.compile(r"^[A-Za-z0-9_.+-]+(?:,[A-Za-z0-9_.+-]+)*$")
# Node features: names joined by Slurm's constraint operators.
_CONSTRAINT_RE: Final = re.compile(r"^[A-Za-z0-9_.:+\-&|,*\[\]()!]+$")
_DIGITS_RE: Final = re.compile(r"^\d+$")
_SLEEP_ID_RE: Final = re.compile(L.ID_PATTERN)
COMMENT_PREFIX: Final = "syscall-kernel"


class SbatchPolicy(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Site and workspace settings that shape every sbatch of a workspace (from the config and the policy)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    nice: Annotated[int, Meta(ge=-2147483645, le=2147483645)] | None = None
    # `gres` asks `--gres=gpu[:type]:N`; `gpus-per-task` asks `--gpus-per-task=[type:]N` (sites differ).
    gpu_flag: Literal["gres", "gpus-per-task"] = "gres"
    gpu_type: str | None = None
    cpus_per_task: Annotated[int, Meta(ge=1, le=4096)] = 1
    cpus_per_gpu: Annotated[int, Meta(ge=0, le=4096)] = 0
    mem_mb: Annotated[int, Meta(ge=1)] = 4096
    mem_per_gpu_mb: Annotated[int, Meta(ge=0)] = 0
    # Walltime asked of Slurm = the launch's minutes + this, for the wrapper's setup and artifact copy-out.
    setup_slack_minutes: Annotated[int, Meta(ge=0, le=24 * 60)] = 5
    # The batch shell gets SIGUSR2 this long before the walltime, to record that it is being killed.
    warn_seconds: Annotated[int, Meta(ge=1, le=65535)] = 120
    # Operator-supplied flags appended before the script (e.g. `--reservation=x`); never agent-controlled.
    extra_args: tuple[str, ...] = ()
    # `--wckey` of every job (the site's workload characterization key), when set.
    wckey: str | None = None


class SbatchJob(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One launch of a sleep, as Slurm is asked to run it."""

    workspace: str
    seq: Annotated[int, Meta(ge=0)]
    launch: str
    minutes: Annotated[int, Meta(ge=1)]
    gpus: Annotated[int, Meta(ge=0)] = 0
    # The launch's own memory (MB) and CPUs per task; None: the policy's (mem_mb, cpus_per_task, and per GPU).
    mem_mb: Annotated[int, Meta(ge=1)] | None = None
    cpus: Annotated[int, Meta(ge=1)] | None = None
    array: Annotated[int, Meta(ge=1)] = 1
    # 0 = the whole array at once.
    concurrency: Annotated[int, Meta(ge=0)] = 0
    # The sleep's request id (in `--comment`; None for jobs made outside a sleep, e.g. tests).
    sleep_id: str | None = None
    # The workspace's own Slurm account (`enroll --account`), else the policy's (the config's `[slurm] account`).
    account: str | None = None


# sbatch failures worth another try: the controller is slow, busy or briefly unreachable, or a submit limit that
# clears as jobs end. The job may exist all the same (a timeout after creating it): look by name before retrying.
_TRANSIENT_RE: Final = re.compile(
    r"timed? ?out|unable to contact|temporarily|try again|resource temporarily unavailable|connection refused|"
    r"communication|zero bytes were transmitted|slurm_persist_conn|socket|transient|busy|"
    r"job submit limit|MaxSubmitJob|sending (?:message|msg)",
    re.I,
)


def sbatch_failure(returncode: int | None, stderr: str) -> Literal["transient", "refused"]:
    """Why an sbatch that printed no job id failed: `transient` (retry after a lookup by name) or `refused`.

    `refused` is permanent: Slurm examined the request and said no (an invalid partition, account, QOS, GRES or
    node configuration; `error: Batch job submission failed: ...`, or a client-side `error: Invalid ...`), so
    the same request fails the same way forever. A timeout (`returncode` None) or an unreachable, busy or
    limited controller is `transient`.
    """
    if returncode is None or _TRANSIENT_RE.search(stderr):
        return "transient"
    return "refused"


class Submitted(Struct, frozen=True):
    """What `sbatch --parsable` answered: the (array) job id and, on a multi-cluster site, the cluster."""

    job_id: str
    cluster: str | None = None


def job_name(workspace: str, seq: int, launch: str) -> str:
    """The unique Slurm job name of one launch of one sleep."""
    if not _WORKSPACE_RE.match(workspace):
        raise ValueError(f"workspace key {workspace!r} is not a workspace key ([A-Za-z0-9_-], 1-64 chars)")
    if seq < 0:
        raise ValueError(f"sleep seq must be >= 0, got {seq}")
    if not _LAUNCH_RE.match(launch):
        raise ValueError(f"launch name {launch!r} does not match {L.NAME_PATTERN}")
    return f"{JOB_NAME_PREFIX}-{workspace}-{seq}-{launch}"


def job_comment(workspace: str, seq: int, launch: str, sleep_id: str | None) -> str:
    """`--comment` of a launch's job: who it is for, in words `squeue -o %k` shows (docs/slurm.md), e.g.
    `syscall-kernel ws=run-17-0a1b2c3d4e sleep=s-42 seq=7 launch=train`. Every part is a checked key, id or
    name (no spaces, quotes or separators), so the comment reads back unambiguously."""
    job_name(workspace, seq, launch)  # the same checks
    parts = [COMMENT_PREFIX, f"ws={workspace}"]
    if sleep_id is not None:
        if not _SLEEP_ID_RE.match(sleep_id):
            raise ValueError(f"sleep id {sleep_id!r} does not match {L.ID_PATTERN}")
        parts.append(f"sleep={sleep_id}")
    parts += [f"seq={seq}", f"launch={launch}"]
    return " ".join(parts)


def parse_job_name(name: str) -> tuple[str, int, str] | None:
    """(workspace, seq, launch) of a name made by `job_name` from a `workspace_key`, or None for other jobs.

    Lookups after a crash compare whole names with `job_name(...)`; this split is for listings and diagnostics.
    """
    m = _JOB_NAME_RE.match(name)
    return (m["ws"], int(m["seq"]), m["launch"]) if m else None


def _check_word(field: str, value: str | None, pattern: re.Pattern[str] = _SLURM_WORD_RE) -> None:
    if value is not None and not pattern.match(value):
        raise ValueError(f"sbatch policy {field}={value!r} has characters Slurm does not accept there")


def _check_path(field: str, path: str) -> None:
    # `%` and `\` are Slurm filename-pattern syntax: a run dir containing them would be rewritten by Slurm.
    if "%" in path or "\\" in path:
        raise ValueError(f"{field} {path!r} contains '%' or '\\', which Slurm treats as a filename pattern")
    if not path.startswith("/"):
        raise ValueError(f"{field} {path!r} must be absolute (Slurm resolves relative paths on the node)")


def walltime_minutes(job: SbatchJob, policy: SbatchPolicy) -> int:
    return job.minutes + policy.setup_slack_minutes


def default_resources(gpus: int, policy: SbatchPolicy) -> tuple[int, int]:
    """The CPUs and memory (MB) a task of `gpus` GPUs gets when its launch asks for neither."""
    return max(policy.cpus_per_task, gpus * policy.cpus_per_gpu), policy.mem_mb + gpus * policy.mem_per_gpu_mb


def render_sbatch_argv(
    job: SbatchJob, policy: SbatchPolicy, paths: RunPaths, sbatch: str = "sbatch"
) -> list[str]:
    """The argv that submits `job` (its `job.sh` in the run directory) under `policy`."""
    # Struct constraints hold only for decoded values; a directly built job is checked here.
    if (
        job.minutes < 1
        or job.gpus < 0
        or job.array < 1
        or job.concurrency < 0
        or (job.mem_mb is not None and job.mem_mb < 1)
        or (job.cpus is not None and job.cpus < 1)
    ):
        raise ValueError(
            f"bad job sizes: minutes={job.minutes} (>= 1), gpus={job.gpus} (>= 0), array={job.array} (>= 1), "
            f"concurrency={job.concurrency} (>= 0), mem_mb={job.mem_mb} (>= 1 or None), cpus={job.cpus} "
            "(>= 1 or None)"
        )
    if job.array > SLURM_ARRAY_MAX:
        raise ValueError(
            f"array of {job.array} tasks exceeds Slurm's default MaxArraySize ({SLURM_ARRAY_MAX})"
        )
    if paths.workspace != job.workspace or paths.seq != job.seq or paths.launch != job.launch:
        raise ValueError(
            f"run paths ({paths.workspace}, {paths.seq}, {paths.launch}) do not belong to job "
            f"({job.workspace}, {job.seq}, {job.launch})"
        )
    for field in ("partition", "account", "qos", "gpu_type", "wckey"):
        _check_word(field, getattr(policy, field))
    _check_word("workspace account", job.account)
    _check_word("constraint", policy.constraint, _CONSTRAINT_RE)
    name = job_name(job.workspace, job.seq, job.launch)
    comment = job_comment(job.workspace, job.seq, job.launch, job.sleep_id)
    launch_dir = str(paths.launch_dir)
    script = str(paths.launch_dir / paths.JOB_SCRIPT)
    if job.array == 1:
        output = str(paths.task_file(0, 1, paths.SCHEDULER_OUT))
    else:
        # %a is the array index: each task's scheduler output lands in its own `<launch>.<k>/`.
        output = str(paths.sleep_dir / f"{job.launch}.%a" / paths.SCHEDULER_OUT)
    _check_path("run directory", launch_dir)

    cpus, mem = default_resources(job.gpus, policy)
    # What the launch asked for is what the task gets (within the workspace's policy, checked at `sleep`).
    cpus = cpus if job.cpus is None else job.cpus
    mem = mem if job.mem_mb is None else job.mem_mb
    argv = [
        sbatch,
        "--parsable",
        f"--job-name={name}",
        f"--comment={comment}",
        f"--chdir={launch_dir}",
        f"--output={output}",
        f"--error={output}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={cpus}",
        f"--mem={mem}M",
        f"--time={walltime_minutes(job, policy)}",
    ]
    if job.array > 1:
        throttle = f"%{job.concurrency}" if 0 < job.concurrency < job.array else ""
        argv.append(f"--array=0-{job.array - 1}{throttle}")
    if job.gpus:
        kind = f"{policy.gpu_type}:" if policy.gpu_type else ""
        if policy.gpu_flag == "gres":
            argv.append(f"--gres=gpu:{kind}{job.gpus}")
        else:
            argv.append(f"--gpus-per-task={kind}{job.gpus}")
    for flag, value in (
        ("partition", policy.partition),
        ("account", job.account or policy.account),
        ("qos", policy.qos),
        ("constraint", policy.constraint),
        ("wckey", policy.wckey),
    ):
        if value is not None:
            argv.append(f"--{flag}={value}")
    if policy.nice is not None:
        argv.append(f"--nice={policy.nice}")
    argv += [f"--signal=B:USR2@{policy.warn_seconds}", "--kill-on-invalid-dep=yes"]
    argv += list(policy.extra_args)
    argv.append(script)
    return argv


def parse_sbatch_output(stdout: str) -> Submitted:
    """Read `sbatch --parsable`: the last non-empty line is `id` or `id;cluster`; site banners come before it."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise SlurmOutputError("sbatch --parsable printed nothing (expected a job id on its last line)")
    job_id, _, cluster = lines[-1].partition(";")
    if not _DIGITS_RE.match(job_id):
        raise SlurmOutputError(
            f"sbatch --parsable printed {lines[-1]!r} on its last line, not `id` or `id;cluster`"
        )
    return Submitted(job_id=job_id, cluster=cluster or None)
