"""The Slurm backend: runs each launch's `job.sh` as one sbatch job (an array for a sweep) and tracks it cheaply.

Submission. `submit` records the JobSpec in `<launch dir>/slurm.json` first, then runs `sbatch --parsable`.
Whenever a job may already exist (a retry, or a launch recorded before a restart) it first looks the launch's
unique job name up with one `squeue` (a job submitted before a crash, or by an `sbatch` that timed out after
creating it, is adopted, never duplicated). Transient failures (a timeout, an unreachable or busy
controller) are retried with backoff, each retry looking by name first; a permanent refusal raises
`SlurmRefused` (a `BackendRefused`: the agent's), retries running out `SlurmSubmitError` (a `BackendUnavailable`:
the world's). The job id lands atomically in `<launch dir>/slurm-job.json`, so `recover` needs no scheduler call for it.

Tracking (the `run` service loop). The wrapper's `exit-code` is the ground truth for a task that ran: every
file tick (`file_poll_s`, beside the polls so a hanging squeue never delays it) stats `exit-code` once per open
task not last seen PENDING (every open task while squeue fails), which works on NFS where inotify does not. A
SIGTERM the kernel did not send (`terminated`) is reported once Slurm says why (TIMEOUT at the walltime,
PREEMPTED, CANCELLED by scancel). Once per poll interval (`kernel.backends.slurm.poll_interval`: adaptive, backing off while the controller fails) ONE
batched `squeue` covers every tracked job. A task that left the queue (or ended) without an exit file gets one
batched `sacct -S <earliest submit>` for all such tasks, only where accounting exists (a cluster answering
"accounting storage is disabled" is never asked again). A failed or timed-out query is "unknown" and changes
nothing. When Slurm says a task ended without an exit file (OOM, NODE_FAIL, PREEMPTED, cancelled, vanished), or
pending for a reason that never clears (the task is then cancelled), the backend writes the exit record itself
(`exit_record_for`), after `exit_grace_s` (NFS attribute caches may hide a fresh file), so every finished task
is reported the same way: a `TaskExit` from `wait_any_exit`, its `exit-code` in place, and `slurm-state.json`
beside it with Slurm's view (`read_task_state`). Healthy waits wake nothing.

File I/O (exit records, `slurm.json`, the recovery glob) is on plain threads, not a workspace's bounded pool:
every file is under the kernel's own `run_dir`, written by the kernel and its wrapper only (no jail binds any of
it), and one batch covers every workspace's tasks; a hang there is the shared filesystem's outage, which stalls
every workspace alike and which no per-workspace deadline could isolate.

Every client runs with a timeout (`squeue` alone takes 9-18 s to fail while slurmctld is down) inside the
service loop, never on the request path; `cancel` asks `scancel` once and, if the controller does not answer,
the loop asks again each cycle until the tasks end.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from channel.messages import TaskState
from kernel.backends import jobscript
from kernel.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    BackendUnavailable,
    JobSpec,
    Recovered,
    TaskExit,
    TaskRef,
)
from kernel.backends.slurm import (
    Resolution,
    SacctResult,
    SbatchJob,
    SbatchPolicy,
    SlurmOutputError,
    SqueueResult,
    SqueueRow,
    TaskKey,
    job_name,
    parse_sbatch_output,
    poll_interval,
    read_sacct,
    read_squeue,
    render_sbatch_argv,
    resolve_task,
    sacct_argv,
    sbatch_failure,
    scancel_argv,
    squeue_argv,
    squeue_by_name_argv,
)
from kernel.backends.slurm.classify import RUNNING_STATES
from kernel.backends.slurm.outage import Outage
from kernel.backends.slurm.query import parse_squeue
from kernel.core import exits
from kernel.core.exits import Outcome
from kernel.io import hostproc, metrics
from kernel.io import log as klog
from kernel.io.crash import crash_point

if TYPE_CHECKING:
    from kernel.core.config import SlurmConfig

SPEC_FILE: Final = "slurm.json"
SLURM_CLIENT: Final = hostproc.declare(
    "slurm.client",
    agent_input="none: argvs rendered by kernel.backends.slurm.submit/query from validated values (a launch's "
    "name, sizes and the operator's options), never a shell; the job script is the kernel's rendering",
    containment="the Slurm clients with the kernel's environment, the backend's client_timeout_s deadline, "
    "stdin /dev/null",
)
JOB_FILE: Final = "slurm-job.json"
STATE_FILE: Final = "slurm-state.json"
CANCEL_FILE: Final = "slurm-cancelled.json"  # tasks the kernel asked to stop

# Kinds of the exit records this backend writes for tasks that ended without one (besides the wrapper's).
KIND_STUCK: Final = "stuck"
KIND_SUBMIT_FAILED: Final = "submit_failed"  # a launch recover() resubmitted was refused
KIND_OF_STATE: Final[Mapping[str, tuple[int, str]]] = {
    "TIMEOUT": (jobscript.EXIT_TIMEOUT, "timeout"),
    "CANCELLED": (jobscript.EXIT_TERMINATED, jobscript.KIND_CANCELLED),
    "OUT_OF_MEMORY": (jobscript.EXIT_LOST, "out_of_memory"),
    "NODE_FAIL": (jobscript.EXIT_LOST, "node_fail"),
    "PREEMPTED": (jobscript.EXIT_LOST, "preempted"),
    "FAILED": (jobscript.EXIT_LOST, "failed"),
    "VANISHED": (jobscript.EXIT_LOST, "vanished"),
}


# How long a SIGTERM'd task (not by the kernel) may stay RUNNING in squeue before it is reported anyway.
TERMINATED_WAIT_S: Final = 120.0
OUTSIDE_HINT: Final = "stopped from outside the kernel (scancel, the scheduler or an administrator)"


class SlurmSubmitError(BackendUnavailable):
    """The job could not be submitted: the scheduler stayed unreachable or busy through every retry (the world's
    fault; the kernel tries again later)."""


class SlurmRefused(BackendRefused):
    """sbatch refused the job permanently (invalid partition, account, QOS, GRES, node configuration): the same
    request fails the same way every time, so it is answered, never retried. `detail` is Slurm's own reason."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"sbatch refused {name}: {detail}", detail)
        self.name = name


class JobRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`slurm-job.json`: what sbatch answered (or the job found by name), and when it was submitted."""

    job_id: str
    name: str
    submitted_at: float  # time.time(); sacct's -S is the earliest of these
    cluster: str | None = None
    adopted: bool = False  # found by name rather than returned by our own sbatch


class TaskSlurmState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`slurm-state.json` beside a reported task's exit-code: how the backend classified it."""

    job_id: str
    state: TaskState
    hint: str | None = None
    slurm_state: str | None = None  # the last state squeue/sacct showed, when it showed one


class Completed(msgspec.Struct, frozen=True):
    """One client run: `returncode` None when it timed out or could not be started."""

    returncode: int | None
    stdout: str
    stderr: str


def policy_from_config(cfg: SlurmConfig, **overrides: object) -> SbatchPolicy:
    """The sbatch policy of the site config (`[slurm]`); `overrides` replace single fields (tests, benches)."""
    fields: dict[str, object] = {
        "partition": cfg.partition,
        "account": cfg.account,
        "qos": cfg.qos,
        "constraint": cfg.constraint,
        "nice": cfg.nice,
        "gpu_flag": cfg.gpu_flag,
        "gpu_type": cfg.gpu_type,
        "cpus_per_task": cfg.cpus_per_task,
        "cpus_per_gpu": cfg.cpus_per_gpu,
        "mem_mb": cfg.mem_mb,
        "mem_per_gpu_mb": cfg.mem_per_gpu_mb,
        "setup_slack_minutes": cfg.setup_slack_minutes,
        "warn_seconds": cfg.warn_seconds,
        "extra_args": tuple(cfg.extra_args),
        "wckey": cfg.wckey,
    }
    fields.update(overrides)
    return msgspec.convert(fields, SbatchPolicy)


def client_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment for the Slurm clients; sbatch passes it on to the job (--export=ALL), so it holds nothing
    of the kernel's own: the search path, a locale, and the client configuration."""
    env = {"PATH": base.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    for name in ("SLURM_CONF", "HOME"):
        if name in base:
            env[name] = base[name]
    return env


def exit_record_for(res: Resolution, stuck: bool = False) -> jobscript.ExitRecord:
    """The exit record written for a task that Slurm ended (or left stuck) without the wrapper writing one."""
    if stuck:
        return jobscript.ExitRecord(
            jobscript.EXIT_LOST,
            KIND_STUCK,
            detail=f"{res.hint}; the task was cancelled so it never runs late",
        )
    state = res.state or "VANISHED"
    code, kind = KIND_OF_STATE.get(state, (jobscript.EXIT_LOST, "vanished"))
    detail = f"Slurm: {state}" + (f"; {res.hint}" if res.hint else "")
    if res.exit_code is not None or res.signal is not None:
        detail += f" (ExitCode {res.exit_code or 0}:{res.signal or 0})"
    return jobscript.ExitRecord(code, kind, detail=detail + "; the job wrapper wrote no exit-code")


def outcome_with(rec: jobscript.ExitRecord, slurm: TaskState | None) -> Outcome:
    """How a finished task ended: its exit record through the one table (kernel.core.exits), with Slurm's own
    state (`slurm`) where Slurm explained the end (a SIGTERM at the walltime, a preemption, the memory limit)."""
    return exits.outcome(rec.kind, rec.code, rec.signal, slurm, rec.detail)


def outcome_of(task_dir: Path) -> Outcome | None:
    """`Backend.outcome_of`: the exit record with the state the backend recorded in `slurm-state.json` (once it
    classified the end; before that the exit record alone). None while there is no exit record."""
    rec = jobscript.read_exit(task_dir)
    if rec is None:
        return None
    st = read_task_state(task_dir)
    return outcome_with(rec, None if st is None else st.state)


def read_task_state(task_dir: Path) -> TaskSlurmState | None:
    try:
        return msgspec.json.decode((task_dir / STATE_FILE).read_bytes(), type=TaskSlurmState)
    except FileNotFoundError:
        return None


def _launch_of(task_dir: Path) -> tuple[Path, int]:
    """(launch dir, task index) of a task directory: the launch dir itself, or `<launch>.<k>/` of an array."""
    if (task_dir / SPEC_FILE).exists():
        return task_dir, 0
    launch, _, k = task_dir.name.rpartition(".")
    return task_dir.parent / launch, int(k) if k.isdigit() else -1


def hint_of(task_dir: Path) -> str | None:
    """The backend's explanation of a task's end, for the wake: its classification (`slurm-state.json`) once
    written; before that (the executor reads the wrapper's exit file as soon as it appears), for a SIGTERM the
    kernel did not send (`slurm-cancelled.json`), that it came from outside the kernel."""
    st = read_task_state(task_dir)
    if st is not None:
        return st.hint
    launch_dir, task = _launch_of(task_dir)
    if not (launch_dir / JOB_FILE).exists():
        return None  # not a task this backend submitted
    rec = jobscript.read_exit(task_dir)
    if rec is None or rec.kind != "terminated":
        return None
    try:
        cancelled = msgspec.json.decode((launch_dir / CANCEL_FILE).read_bytes(), type=list[int])
    except FileNotFoundError:
        cancelled = []
    return None if task in cancelled else OUTSIDE_HINT


def _write_json(directory: Path, name: str, value: object) -> None:
    jobscript.write_atomic(directory, name, msgspec.json.encode(value) + b"\n", 0o644)


@dataclass
class _Launch:
    spec: JobSpec
    name: str
    job: JobRecord | None = None  # None while the submission is in flight
    open: set[int] = field(default_factory=set)  # tasks not reported yet
    cancelled: set[int] = field(default_factory=set)  # the kernel asked for these to stop
    unscancelled: set[int] = field(default_factory=set)  # asked, but scancel has not succeeded yet
    slurm_state: dict[int, str] = field(default_factory=dict)
    # Tasks the last good squeue showed PENDING, and since when: the only ones the file tick skips.
    pending_since: dict[int, float] = field(default_factory=dict)
    ended_since: dict[int, float] = field(default_factory=dict)  # Slurm says over, no exit file yet

    def key_of(self, task: int) -> TaskKey:
        assert self.job is not None
        return (self.job.job_id, task if self.spec.array > 1 else None)

    def ref(self, task: int) -> TaskRef:
        return TaskRef(key=self.spec.key, task=task, job_id=self.task_job_id(task))

    def task_job_id(self, task: int) -> str:
        if self.job is None:
            return ""
        return self.job.job_id if self.spec.array == 1 else f"{self.job.job_id}_{task}"


Sleep = Callable[[float], Awaitable[None]]


class SlurmBackend:
    name = "slurm"

    def __init__(
        self,
        *,
        policy: SbatchPolicy | None = None,
        env: Mapping[str, str] | None = None,
        client_timeout_s: float = 30.0,
        submit_timeout_s: float = 60.0,
        submit_attempts: int = 6,
        backoff_s: float = 2.0,
        backoff_max_s: float = 60.0,
        poll_floor_s: float = 2.0,
        poll_ceiling_s: float = 60.0,
        file_poll_s: float = 1.0,
        exit_grace_s: float = 15.0,
        requeues: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        """`env` is where the clients are found (PATH, SLURM_CONF); `exit_grace_s` is how long a task Slurm
        says has ended may lack its exit file before the backend writes one (NFS caches); `sleep` is the
        backoff's sleep (tests inject one)."""
        if submit_attempts < 1:
            raise ValueError(f"submit_attempts must be >= 1, got {submit_attempts}")
        self.policy = policy or SbatchPolicy()
        self.env = client_env(os.environ if env is None else env)
        self.client_timeout_s = client_timeout_s
        self.submit_timeout_s = submit_timeout_s
        self.submit_attempts = submit_attempts
        # Whether the scheduler's clients fail for the world's reasons now, since when (kernel.backends.slurm.outage).
        self.outage = Outage(clock)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.poll_floor_s = poll_floor_s
        self.poll_ceiling_s = poll_ceiling_s
        self.file_poll_s = file_poll_s
        self.exit_grace_s = exit_grace_s
        self.requeues = requeues
        self.uid = os.getuid()
        self._clock = clock
        self._sleep = sleep
        self._launches: dict[str, _Launch] = {}
        self._accounting: bool | None = None  # None: not asked yet; False: the cluster has none
        self._failures = 0  # consecutive unknown squeue answers
        self._last_change = clock()
        self._wake = anyio.Event()
        self._poll_now = False
        self._exits_in, self._exits_out = anyio.create_memory_object_stream[TaskExit](math.inf)
        self._tg: TaskGroup | None = None
        # Exit records this backend could not write (a full disk), by task directory: read by `outcome_of`.
        self._held: dict[Path, jobscript.ExitRecord] = {}
        # Work recover() found before run() started (resubmissions): run() starts it first.
        self._deferred: list[Callable[[], Coroutine[Any, Any, None]]] = []

    @classmethod
    def from_config(
        cls, cfg: SlurmConfig, *, policy: SbatchPolicy | None = None, **kw: object
    ) -> SlurmBackend:
        """The backend `[slurm]` describes (kernel.service.factory.make_backend); `kw` overrides (env, clock, sleep)."""
        args: dict[str, object] = {
            "policy": policy or policy_from_config(cfg),
            "client_timeout_s": cfg.client_timeout_seconds,
            "submit_timeout_s": cfg.submit_timeout_seconds,
            "submit_attempts": cfg.submit_attempts,
            "poll_floor_s": cfg.poll_seconds,
            "poll_ceiling_s": cfg.poll_max_seconds,
            "file_poll_s": cfg.file_poll_seconds,
            "exit_grace_s": cfg.exit_grace_seconds,
            "requeues": cfg.requeues,
        }
        args.update(kw)
        return cls(**args)  # type: ignore[arg-type]

    # --- queries ---------------------------------------------------------------------------------------------

    @property
    def tracked_jobs(self) -> list[str]:
        return sorted({la.job.job_id for la in self._launches.values() if la.job and la.open})

    def open_tasks(self, key: str) -> list[int]:
        la = self._launches.get(key)
        return sorted(la.open) if la else []

    def job_of(self, key: str) -> JobRecord | None:
        la = self._launches.get(key)
        return la.job if la else None

    # --- clients ---------------------------------------------------------------------------------------------

    async def _client(self, argv: list[str], limit_s: float | None = None) -> Completed:
        out = await self._run_client(argv, limit_s)
        self._observe(argv, out)
        return out

    async def _run_client(self, argv: list[str], limit_s: float | None) -> Completed:
        limit = limit_s or self.client_timeout_s
        try:
            out = await hostproc.run_async(SLURM_CLIENT, argv, env=self.env, limit_s=limit)
        except OSError as e:
            return Completed(None, "", f"{argv[0]} could not be started: {e}")
        except hostproc.TimeoutExpired:
            return Completed(None, "", f"{argv[0]} did not answer within {limit:g} s")
        return Completed(
            out.returncode, out.stdout.decode(errors="replace"), out.stderr.decode(errors="replace")
        )

    def _observe(self, argv: list[str], out: Completed) -> None:
        """Log every client call that fails, and the scheduler's outages: one `slurm_outage` line at err when
        calls start failing for the world's reasons (timeouts, an unreachable or busy controller), one
        `slurm_outage_ended` with its length when a call succeeds again."""
        tool = os.path.basename(argv[0])
        metrics.SCHEDULER_CALLS.labels(call=tool, outcome="ok" if out.returncode == 0 else "failed").inc()
        if out.returncode == 0:
            ended = self.outage.succeeded()
            if ended is not None:
                metrics.SLURM_OUTAGE_SINCE.set(0)
                klog.event(
                    "slurm_outage_ended",
                    lasted_s=ended.lasted_s,
                    since=klog.rfc3339(ended.since_wall),
                    first_failure_after_s=ended.first_failure_after_s,
                    failed_calls=ended.failed_calls,
                    call=tool,
                )
            return
        detail = (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}").splitlines()[0][:300]
        klog.event("slurm_call_failed", logging.WARNING, call=tool, rc=out.returncode, error=detail)
        if sbatch_failure(out.returncode, out.stderr) == "transient" or out.returncode is None:
            began = self.outage.failed(f"{tool}: {detail}")
            if began is not None:
                metrics.SLURM_OUTAGE_SINCE.set(began.since_wall)
                klog.event(
                    "slurm_outage",
                    logging.ERROR,
                    call=tool,
                    error=detail,
                    since=klog.rfc3339(began.since_wall),
                )

    def degraded(self) -> str | None:
        """While the scheduler's clients fail for the world's reasons: since when, and the latest error."""
        since = self.outage.since_wall
        if since is None:
            return None
        return (
            f"Slurm unreachable since {klog.rfc3339(since)} ({self.outage.failed_calls} calls failed, the latest "
            f"{self.outage.last_error})"
        )

    # --- submission ------------------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> list[TaskRef]:
        try:
            return await self._submit(spec)
        except OSError as e:  # the run directory cannot be read or written: the world's, tried again later
            raise BackendUnavailable(f"submitting {spec.key}: {e}") from e

    async def _submit(self, spec: JobSpec) -> list[TaskRef]:
        if spec.key in self._launches:
            la = self._launches[spec.key]
            return [la.ref(t) for t in range(spec.array)]
        launch_dir = spec.paths.launch_dir
        if not (launch_dir / jobscript.NAMES.JOB_SCRIPT).is_file():
            raise FileNotFoundError(
                f"{launch_dir}: job.sh is missing; write it with kernel.backends.jobscript first"
            )
        la = _Launch(spec, job_name(spec.workspace, spec.seq, spec.launch), open=set(range(spec.array)))
        self._launches[spec.key] = la
        try:
            if (launch_dir / JOB_FILE).exists():  # submitted before a restart that skipped recover()
                la.job = msgspec.json.decode((launch_dir / JOB_FILE).read_bytes(), type=JobRecord)
            else:
                await self._submit_launch(la)
        except BaseException:
            if la.job is None and not la.cancelled:
                del self._launches[spec.key]
            raise
        self._poke()
        return [la.ref(t) for t in range(spec.array)]

    async def _submit_launch(self, la: _Launch) -> None:
        spec = la.spec
        for t in range(spec.array):
            spec.task_dir(t).mkdir(mode=0o700, parents=True, exist_ok=True)
        # A launch recorded for the first time cannot have a job yet: its first sbatch needs no lookup.
        fresh = not (spec.paths.launch_dir / SPEC_FILE).exists()
        if fresh:
            _write_json(spec.paths.launch_dir, SPEC_FILE, spec)
        job = SbatchJob(
            workspace=spec.workspace,
            seq=spec.seq,
            launch=spec.launch,
            minutes=spec.minutes,
            gpus=spec.gpus,
            mem_mb=spec.mem_mb,
            cpus=spec.cpus,
            array=spec.array,
            concurrency=spec.concurrency,
            sleep_id=spec.sleep_id or None,
            account=spec.account,
        )
        argv = render_sbatch_argv(job, self.policy, spec.paths)
        problems: list[str] = []
        for attempt in range(self.submit_attempts):
            if attempt:
                delay = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
                klog.event(
                    "slurm_retry",
                    logging.WARNING,
                    launch=la.name,
                    attempt=attempt + 1,
                    of=self.submit_attempts,
                    after_s=delay,
                    last=problems[-1][:200] if problems else None,
                )
                await self._sleep(delay)
            if not la.open:
                return  # cancelled while we waited: nothing to submit
            found, detail = ({}, "") if attempt == 0 and fresh else await self._lookup([la])
            if found is None:
                problems.append(f"looking up {la.name}: {detail}")
                continue
            if la.name in found:
                ids = found[la.name]
                self._record(la, JobRecord(ids[0], la.name, time.time(), adopted=True))
                if len(ids) > 1:  # an earlier kernel made duplicates: keep the oldest only
                    await self._client(scancel_argv(ids[1:]))  # found by the lookup: the local cluster
                break
            out = await self._client(argv, limit_s=self.submit_timeout_s)
            if out.returncode == 0:
                try:
                    sub = parse_sbatch_output(out.stdout)
                except SlurmOutputError as e:
                    problems.append(str(e))  # the job may exist: the next attempt looks by name
                    continue
                crash_point("sbatch")  # TEST ONLY: the job exists, its id is recorded nowhere
                self._record(la, JobRecord(sub.job_id, la.name, time.time(), cluster=sub.cluster))
                break
            detail = (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}")[:500]
            problems.append(f"sbatch: {detail}")
            if sbatch_failure(out.returncode, detail) == "refused":
                # No job exists: a restart must not find this launch recorded and submit it again.
                (spec.paths.launch_dir / SPEC_FILE).unlink(missing_ok=True)
                raise SlurmRefused(la.name, detail)
        else:
            raise SlurmSubmitError(
                f"{la.name} was not submitted after {self.submit_attempts} attempts: "
                + " | ".join(problems[-3:])
            )
        if la.cancelled and la.job is not None:  # cancel() came while sbatch ran
            la.unscancelled |= la.cancelled
            await self._scancel(la)

    @staticmethod
    def _mark_cancelled(la: _Launch, tasks: Iterable[int]) -> None:
        """Remember (across restarts too) that the kernel stopped these tasks: their end is not news to it."""
        la.cancelled.update(tasks)
        with contextlib.suppress(OSError):
            _write_json(la.spec.paths.launch_dir, CANCEL_FILE, sorted(la.cancelled))

    def _record(self, la: _Launch, rec: JobRecord) -> None:
        _write_json(la.spec.paths.launch_dir, JOB_FILE, rec)
        la.job = rec

    async def _lookup(self, launches: Sequence[_Launch]) -> tuple[dict[str, list[str]] | None, str]:
        """Our jobs of these launches (oldest first) by name, from one squeue; None when squeue did not answer.

        A job counts only if its working directory is the launch's own directory: a name reused after the
        kernel's state was reset (the finished job still listed for MinJobAge) is never mistaken for ours.
        """
        out = await self._client(squeue_by_name_argv(la.name for la in launches))
        if out.returncode != 0:
            return None, (out.stderr.strip() or f"squeue exited {out.returncode}")[:500]
        workdir = {la.name: str(la.spec.paths.launch_dir) for la in launches}
        found: dict[str, set[str]] = {}
        for line in out.stdout.splitlines():
            name, _, rest = line.strip().partition("|")
            where, sep, rest = rest.partition("|")
            if not sep or workdir.get(name) != where:
                continue
            try:
                rows = parse_squeue(rest)
            except SlurmOutputError as e:
                return None, str(e)
            for row in rows.values():
                found.setdefault(name, set()).add(row.array_job_id)
        return {n: sorted(ids, key=lambda i: (len(i), i)) for n, ids in found.items()}, ""

    # --- cancel ----------------------------------------------------------------------------------------------

    async def cancel(self, key: str, tasks: Sequence[int] | None = None) -> list[TaskRef]:
        try:
            return await self._cancel(key, tasks)
        except OSError as e:  # an exit record cannot be written: the world's, tried again later
            raise BackendUnavailable(f"cancelling {key}: {e}") from e

    async def _cancel(self, key: str, tasks: Sequence[int] | None) -> list[TaskRef]:
        la = self._launches.get(key)
        if la is None:
            return []
        wanted = sorted(la.open if tasks is None else la.open & set(tasks))
        if not wanted:
            return []
        refs = [la.ref(t) for t in wanted]
        self._mark_cancelled(la, wanted)
        if la.job is None:
            # Not submitted (yet): the submission stops, or cancels what it finds, and these tasks end now.
            for t in wanted:
                rec = jobscript.ExitRecord(
                    jobscript.EXIT_TERMINATED,
                    jobscript.KIND_CANCELLED,
                    detail="cancelled before it was submitted",
                )
                await self._write_exit(la.spec.task_dir(t), rec)
                self._report(la, t, Resolution("done", "CANCELLED"))
            return refs
        # The whole job when asked for all: one scancel also stops tasks Slurm has not split off yet.
        la.unscancelled.update(range(la.spec.array) if tasks is None else wanted)
        await self._scancel(la)
        self._poll_now = True
        self._poke()
        return refs

    async def _scancel(self, la: _Launch) -> bool:
        if la.job is None or not la.unscancelled:
            return True
        todo = la.unscancelled
        where = [la.job.cluster] if la.job.cluster else None
        if la.spec.array == 1 or todo >= set(range(la.spec.array)):
            argv = scancel_argv([la.job.job_id], clusters=where)
        else:
            argv = scancel_argv((f"{la.job.job_id}_{t}" for t in sorted(todo)), clusters=where)
        out = await self._client(argv)
        # Exit 1 "Invalid job id" for tasks that already ended is fine: they end through the loop anyway.
        if out.returncode == 0 or (out.returncode is not None and "invalid job id" in out.stderr.lower()):
            la.unscancelled.clear()
            return True
        return False

    # --- the service loop ------------------------------------------------------------------------------------

    def _poke(self) -> None:
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The service loop: file ticks and scheduler polls run side by side, so a squeue that hangs while the
        controller is down (9-18 s) never delays the exits the wrapper files already tell."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            deferred, self._deferred = self._deferred, []
            for go in deferred:
                tg.start_soon(go)
            task_status.started()
            try:
                tg.start_soon(self._file_loop)
                await self._poll_loop()
            finally:
                self._tg = None
                self.close()

    def _idle(self) -> bool:
        return not any((la.open and la.job) or la.unscancelled for la in self._launches.values())

    async def _poll_loop(self) -> None:
        next_poll = self._clock() + self.poll_floor_s
        while True:
            if self._idle():
                await self._wake.wait()
                self._wake = anyio.Event()
                next_poll = max(next_poll, self._clock() + self.poll_floor_s)
                continue
            if self._poll_now or self._clock() >= next_poll:
                await self.poll_once()
                next_poll = self._clock() + self.next_interval()
            with anyio.move_on_after(max(0.0, next_poll - self._clock())):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def _file_loop(self) -> None:
        while True:
            await self.check_files()
            await anyio.sleep(self.file_poll_s)

    def close(self) -> None:
        """Close the exit stream (the service loop does this when it stops; tests that drive the cycles by hand
        call it). Jobs are left running: they belong to Slurm."""
        self._exits_in.close()
        self._exits_out.close()

    def next_interval(self) -> float:
        return poll_interval(
            self._clock() - self._last_change,
            self._failures,
            floor_s=self.poll_floor_s,
            ceiling_s=self.poll_ceiling_s,
        )

    async def check_files(self) -> int:
        """One file tick: stat exit-code once per open task not last seen PENDING (all of them while squeue
        fails: a task may have started and ended unseen); report those that have one."""
        blind = self._failures > 0
        todo = [
            (la, t)
            for la in self._launches.values()
            if la.job
            for t in sorted(la.open)
            if blind or t not in la.pending_since
        ]
        if not todo:
            return 0
        # the kernel's own run_dir: a plain thread (see File I/O above)
        found = await anyio.to_thread.run_sync(self._read_exits, todo)
        reported = 0
        for (la, t), rec in zip(todo, found, strict=True):
            # A SIGTERM the kernel did not send is the scheduler's (walltime, preemption) or scancel's: the
            # poll reports it once Slurm says which.
            if rec is not None and not (rec.kind == "terminated" and t not in la.cancelled):
                self._report(la, t, Resolution("done", "RUNNING"), rec)
                reported += 1
        return reported

    @staticmethod
    def _read_exits(todo: Sequence[tuple[_Launch, int]]) -> list[jobscript.ExitRecord | None]:
        out: list[jobscript.ExitRecord | None] = []
        for la, t in todo:
            try:
                out.append(jobscript.read_exit(la.spec.task_dir(t)))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                # The file is there but unreadable: the task is over all the same; say so.
                out.append(
                    jobscript.ExitRecord(
                        jobscript.EXIT_LOST, jobscript.KIND_LOST, detail=f"bad exit-code: {e}"
                    )
                )
        return out

    async def poll_once(self) -> None:
        """One tracking cycle: one squeue for all tracked jobs, sacct for tasks gone without an exit file."""
        self._poll_now = False
        for la in list(self._launches.values()):
            if la.unscancelled:
                await self._scancel(la)
        launches = [la for la in self._launches.values() if la.job and la.open]
        if not launches:
            return
        queue = await self._squeue(launches)
        if not queue.known:
            self._failures += 1
            await self.check_files()  # completions still arrive while the controller is away
            return
        self._failures = 0
        now = self._clock()
        # Exit files are read after the squeue answer: a task ending in between is seen with its file.
        to_read: list[tuple[_Launch, int]] = []
        for la in launches:
            for t in sorted(la.open):
                row = queue.entries.get(la.key_of(t))
                state = row.state if row else None
                if state != la.slurm_state.get(t):
                    self._last_change = now
                    if state is not None:
                        la.slurm_state[t] = state
                if row is not None and row.state == "PENDING":
                    la.pending_since.setdefault(t, now)
                    continue
                la.pending_since.pop(t, None)
                to_read.append((la, t))
        # the kernel's own run_dir: a plain thread (see File I/O above)
        exits = await anyio.to_thread.run_sync(self._read_exits, to_read)
        exit_of = {(id(la), t): rec for (la, t), rec in zip(to_read, exits, strict=True)}
        decisions: list[tuple[_Launch, int, Resolution]] = []
        ask: list[tuple[_Launch, int]] = []
        for la in launches:
            for t in sorted(la.open):
                rec = exit_of.get((id(la), t))
                res = self._resolve(la, t, rec, queue, None, now)
                if res.action == "ask_accounting":
                    ask.append((la, t))
                else:
                    decisions.append((la, t, res))
        if ask:
            acct = await self._sacct(ask)
            for la, t in ask:
                decisions.append((la, t, self._resolve(la, t, None, queue, acct, now)))
        stuck = [(la, t, r) for la, t, r in decisions if r.action == "stuck"]
        if stuck:
            await self._cancel_stuck(stuck)
        for la, t, res in decisions:
            rec = exit_of.get((id(la), t))
            if res.action == "done" and rec is not None:
                row = queue.entries.get(la.key_of(t))
                if rec.kind == "terminated" and t not in la.cancelled and row and row.state in RUNNING_STATES:
                    first = la.ended_since.setdefault(t, now)
                    if now - first < TERMINATED_WAIT_S:
                        continue  # wait for Slurm's end state (TIMEOUT, PREEMPTED, CANCELLED, ...)
                self._report(la, t, res, rec)
            elif res.action == "done":
                first = la.ended_since.setdefault(t, now)
                if now - first >= self.exit_grace_s:
                    await self._finish_without_exit(la, t, res, stuck=False)
            else:
                la.ended_since.pop(t, None)

    async def _squeue(self, launches: Sequence[_Launch]) -> SqueueResult:
        """One squeue for every tracked job (one per cluster on a multi-cluster site: `-M` names it)."""
        groups: dict[str | None, set[str]] = {}
        for la in launches:
            if la.job is not None:
                groups.setdefault(la.job.cluster, set()).add(la.job.job_id)
        entries: dict[TaskKey, SqueueRow] = {}
        for cluster, ids in sorted(groups.items(), key=lambda kv: kv[0] or ""):
            out = await self._client(squeue_argv(ids, clusters=[cluster] if cluster else None))
            if out.returncode is None:
                return SqueueResult(known=False, entries={}, detail=out.stderr)
            part = read_squeue(out.returncode, out.stdout, out.stderr, ids)
            if not part.known:
                return part  # one cluster unknown: nothing is concluded this cycle
            entries.update(part.entries)
        return SqueueResult(known=True, entries=entries)

    def _resolve(
        self,
        la: _Launch,
        t: int,
        rec: jobscript.ExitRecord | None,
        queue: SqueueResult,
        acct: SacctResult | None,
        now: float,
    ) -> Resolution:
        since = la.pending_since.get(t)
        return resolve_task(
            la.key_of(t),
            exit_code=None if rec is None else rec.code,
            queue=queue,
            accounting=acct,
            pending_for_s=0.0 if since is None else now - since,
            our_uid=self.uid,
            cancelled_by_kernel=t in la.cancelled,
            requeues=self.requeues,
        )

    async def _sacct(self, ask: Sequence[tuple[_Launch, int]]) -> SacctResult:
        if self._accounting is False:
            return SacctResult(status="disabled", entries={}, detail="accounting storage is disabled")
        jobs = {la.job.job_id: la.job.submitted_at for la, _ in ask if la.job}
        clusters = {la.job.cluster for la, _ in ask if la.job and la.job.cluster}
        since = datetime.fromtimestamp(min(jobs.values()) - 60, tz=UTC)
        out = await self._client(sacct_argv(jobs, since, clusters=clusters))
        if out.returncode is None:
            return SacctResult(status="unknown", entries={}, detail=out.stderr)
        res = read_sacct(out.returncode, out.stdout, out.stderr)
        if res.status == "disabled":
            self._accounting = False
        elif res.status == "ok":
            self._accounting = True
        return res

    async def _cancel_stuck(self, stuck: Sequence[tuple[_Launch, int, Resolution]]) -> None:
        by_launch: dict[str, list[tuple[_Launch, int, Resolution]]] = {}
        for item in stuck:
            by_launch.setdefault(item[0].spec.key, []).append(item)
        for items in by_launch.values():
            la = items[0][0]
            self._mark_cancelled(la, [t for _, t, _ in items])
            la.unscancelled.update(t for _, t, _ in items)
            if await self._scancel(la):
                for _, t, res in items:
                    await self._finish_without_exit(la, t, res, stuck=True)

    async def _finish_without_exit(self, la: _Launch, t: int, res: Resolution, *, stuck: bool) -> None:
        tdir = la.spec.task_dir(t)
        # The wrapper may have written its record at the last moment: never overwrite one.
        # the kernel's own run_dir: a plain thread (see File I/O above)
        rec = await anyio.to_thread.run_sync(jobscript.read_exit, tdir)
        if rec is None:
            rec = await self._write_exit(tdir, exit_record_for(res, stuck=stuck))
        self._report(la, t, res, rec)

    async def _write_exit(self, tdir: Path, rec: jobscript.ExitRecord) -> jobscript.ExitRecord:
        """Write `rec` as the task's exit record; one that cannot be written (a full disk) is held in memory
        instead (`jobscript.held_record`) and read by `outcome_of`, never raised. Returns the record kept."""
        try:
            # the kernel's own run_dir: a plain thread (see File I/O above)
            await anyio.to_thread.run_sync(jobscript.write_exit, tdir, rec)
        except OSError as e:
            rec = self._held[tdir] = jobscript.held_record(rec, e)
        return rec

    def _report(self, la: _Launch, t: int, res: Resolution, rec: jobscript.ExitRecord | None = None) -> None:
        if t not in la.open:
            return
        tdir = la.spec.task_dir(t)
        state: TaskState = outcome_with(rec, res.state).state if rec is not None else res.state or "VANISHED"
        hint = res.hint if rec is None or rec.code != 0 else None
        if rec is not None and rec.kind == "terminated" and t not in la.cancelled:
            hint = OUTSIDE_HINT
        with contextlib.suppress(OSError):
            _write_json(
                tdir,
                STATE_FILE,
                TaskSlurmState(la.task_job_id(t), state, hint, la.slurm_state.get(t)),
            )
        la.open.discard(t)
        la.ended_since.pop(t, None)
        la.pending_since.pop(t, None)
        self._last_change = self._clock()
        self._exits_in.send_nowait(TaskExit(key=la.spec.key, task=t, task_dir=os.fspath(tdir)))

    def outcome_of(self, task_dir: Path) -> Outcome | None:
        """`outcome_of` (the module function), except that an end other than success on a task this backend still
        tracks is not known (None) until the backend has classified it (`slurm-state.json`): Slurm may say why it
        ended (the walltime, the memory limit, a preemption, scancel), and the backend reports it through
        `wait_any_exit` at its next file tick or poll (a SIGTERM the kernel did not send: once Slurm says which,
        within TERMINATED_WAIT_S while Slurm shows the job running). So the state the kernel records is the state
        in `slurm-state.json`. A record this backend could not write is read from memory. Called from the store
        worker's thread: it only reads the launch and held-record tables."""
        held = self._held.get(task_dir)
        if held is not None and jobscript.read_exit(task_dir) is None:
            return outcome_with(held, None)
        out = outcome_of(task_dir)
        if out is None or out.state == "COMPLETED" or (task_dir / STATE_FILE).exists():
            return out
        launch_dir, t = _launch_of(task_dir)
        for la in list(self._launches.values()):
            if la.spec.paths.launch_dir == launch_dir:
                return None if t in la.open else out
        return out

    def hint_of(self, task_dir: Path) -> str | None:
        """`hint_of` (the module function: it needs only the task's files)."""
        return hint_of(task_dir)

    async def wait_any_exit(self) -> TaskExit:
        return await self._exits_out.receive()

    # --- recovery --------------------------------------------------------------------------------------------

    async def recover(self, run_dir: Path) -> Recovered:
        """Adopt the launches recorded under `run_dir` that this backend does not know yet.

        A launch with `slurm-job.json` is tracked again without asking Slurm; the ones whose sbatch never
        recorded an id are looked up by name with ONE squeue, and resubmitted (`requeued`) only when Slurm has
        no job of that name. The loop then reports whatever ended meanwhile, through `wait_any_exit`.
        """
        # the kernel's own run_dir: a plain thread (see File I/O above)
        specs = await anyio.to_thread.run_sync(lambda: sorted(run_dir.glob(f"*/*/*/{SPEC_FILE}")))
        found: dict[str, list[TaskRef]] = {"running": [], "finished": [], "requeued": [], "lost": []}
        unrecorded: list[_Launch] = []
        ended: list[tuple[_Launch, int]] = []  # refs made after the lookup, so that they carry the job id
        for path in specs:
            spec = msgspec.json.decode(path.read_bytes(), type=JobSpec)
            if spec.key in self._launches:
                continue
            la = _Launch(spec, job_name(spec.workspace, spec.seq, spec.launch))
            job_path = spec.paths.launch_dir / JOB_FILE
            if job_path.exists():
                la.job = msgspec.json.decode(job_path.read_bytes(), type=JobRecord)
            with contextlib.suppress(FileNotFoundError):
                cancelled = (spec.paths.launch_dir / CANCEL_FILE).read_bytes()
                la.cancelled.update(msgspec.json.decode(cancelled, type=list[int]))
            self._launches[spec.key] = la
            for t in range(spec.array):
                if jobscript.read_exit(spec.task_dir(t)) is not None:
                    ended.append((la, t))
                else:
                    la.open.add(t)
            if la.job is None:
                # Even when every task already ended (a fast job finished while the kernel was down), the id
                # is looked up so that the answer and the wake can name the job.
                unrecorded.append(la)
            else:
                found["running"] += [la.ref(t) for t in sorted(la.open)]
        if unrecorded:
            names, _detail = await self._lookup(unrecorded)
            for la in unrecorded:
                if names is not None and la.name in names:
                    self._record(la, JobRecord(names[la.name][0], la.name, time.time(), adopted=True))
                    found["running"] += [la.ref(t) for t in sorted(la.open)]
                elif la.open:
                    # Not found, or squeue did not answer: the submission path looks again before any sbatch.
                    found["requeued"] += [la.ref(t) for t in sorted(la.open)]
                    self._start_background_submit(la)
        found["finished"] = [la.ref(t) for la, t in ended]
        self._poke()
        return Recovered(*(tuple(found[k]) for k in ("running", "finished", "requeued", "lost")))

    def _start_background_submit(self, la: _Launch) -> None:
        async def go() -> None:
            try:
                await self._submit_launch(la)
            except (BackendError, OSError, ValueError) as e:
                for t in sorted(la.open):
                    rec = jobscript.ExitRecord(
                        jobscript.EXIT_WRAPPER_ERROR, KIND_SUBMIT_FAILED, detail=f"resubmission failed: {e}"
                    )
                    rec = await self._write_exit(la.spec.task_dir(t), rec)
                    self._report(la, t, Resolution("done", "FAILED", str(e)), rec)
            self._poke()

        if self._tg is None:
            self._deferred.append(go)  # recover() before run(): started as soon as run() is
        else:
            self._tg.start_soon(go)


if TYPE_CHECKING:  # mypy checks that SlurmBackend is a Backend
    _conforms: Backend = SlurmBackend()
