"""What a finished task left in its run directory, turned into the wake's evidence.

- `outcome`: an `exit-code` record -> the task's lifecycle event, final state, exit code, signal and hint.
- `tail`: the last `TAIL_MAX_CHARS` characters of a (possibly huge, possibly binary) output file.
- `deliver_artifacts`: copy the artifacts the wrapper copied out of the job's tree into the channel's
  `results/<seq>/<launch>[/<task>]/`, through `safefs` only (a level swapped for a symlink by the agent is
  refused, never followed), each listed with the size and sha256 of the bytes actually delivered; every artifact
  not delivered is listed with its reason.
- `build_wake`: the `Wake` message of a sleep from its task results and the budget after refunds.

Everything here runs on the store worker thread (plain blocking I/O on kernel-owned files and one channel fd).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

import msgspec

from channel import limits as L
from channel import safefs
from channel.lifecycle import TaskEvent
from channel.messages import Artifact, SkippedArtifact, TaskResult, Verdict, Wake
from channel.paths import ChannelPaths, RunPaths
from kernel.backends import jobscript
from kernel.backends.slurm.backend import WAKE_STATE_OF_KIND, hint_of
from kernel.core.budget import Balance, gpu_hours
from kernel.io.store import JobRow
from kernel.node import wrapper as W

# What a task's state means for the agent, where channel.render's generic hints do not say enough.
HINT_FAILED: Final = "the command exited with a non-zero status; the stderr tail below usually says why"
HINT_SIGNALED: Final = "the command was killed by {signal}"
HINT_EMPTY: Final = "the command was empty; nothing ran"
HINT_MATERIALISE: Final = (
    "the snapshot could not be written out on the node before the command started; this was not your "
    "command's fault, you may relaunch it"
)
HINT_WRAPPER: Final = (
    "the job wrapper failed around your command (the jail could not start?); see the stderr tail"
)
HINT_LOST: Final = "the job ended without leaving a result (its wrapper was killed); relaunch it"
HINT_CANCELLED_EARLY: Final = "cancelled before it started"


@dataclass(frozen=True, slots=True)
class Outcome:
    event: TaskEvent
    state: str
    exit_code: int | None
    signal: int | None
    hint: str | None


def _signum(name: str | None) -> int | None:
    if not name:
        return None
    try:
        return int(signal.Signals[name])
    except KeyError:
        return None


def outcome(rec: jobscript.ExitRecord) -> Outcome:
    """The task's end as the lifecycle and the wake state it (pure)."""
    sig = _signum(rec.signal)
    ended = WAKE_STATE_OF_KIND.get(rec.kind)
    if ended is not None:  # written by the Slurm backend for a task that ended without the wrapper's record
        event = TaskEvent(ended[0])
        return Outcome(event, ended[1], rec.code if event is TaskEvent.FINISH else None, sig, None)
    match rec.kind:
        case W.KIND_EXITED if rec.code == 0:
            return Outcome(TaskEvent.FINISH, "COMPLETED", 0, None, None)
        case W.KIND_EXITED:
            return Outcome(TaskEvent.FINISH, "FAILED", rec.code, None, HINT_FAILED)
        case W.KIND_SIGNALED:
            return Outcome(
                TaskEvent.FINISH,
                "FAILED",
                rec.code,
                sig,
                HINT_SIGNALED.format(signal=rec.signal or "a signal"),
            )
        case W.KIND_TIMEOUT:
            return Outcome(TaskEvent.FINISH, "TIMEOUT", rec.code, sig, None)
        case W.KIND_TERMINATED:
            return Outcome(TaskEvent.CANCEL, "CANCELLED", rec.code, sig, None)
        case jobscript.KIND_CANCELLED:
            return Outcome(TaskEvent.CANCEL, "CANCELLED", None, None, HINT_CANCELLED_EARLY)
        case W.KIND_EMPTY:
            return Outcome(TaskEvent.FINISH, "FAILED", rec.code, None, HINT_EMPTY)
        case W.KIND_MATERIALISE:
            return Outcome(TaskEvent.FINISH, "FAILED", rec.code, None, HINT_MATERIALISE)
        case jobscript.KIND_LOST:
            return Outcome(TaskEvent.LOSE, "VANISHED", None, sig, HINT_LOST)
        case _:
            return Outcome(TaskEvent.FINISH, "FAILED", rec.code, sig, HINT_WRAPPER)


def stamp(dt: datetime | None) -> float | None:
    return None if dt is None else dt.timestamp()


def task_times(task_dir: Path) -> tuple[float | None, float | None]:
    """(started, ended) as epoch seconds; `ended` falls back to the exit record's mtime (a killed wrapper)."""
    started = stamp(jobscript.read_timestamp(task_dir, RunPaths.STARTED))
    ended = stamp(jobscript.read_timestamp(task_dir, RunPaths.ENDED))
    if started is not None and ended is None:
        with contextlib.suppress(FileNotFoundError):
            ended = (task_dir / RunPaths.EXIT_CODE).stat().st_mtime
    return started, ended


def gpu_seconds_used(gpus: int, elapsed_s: float | None) -> int:
    return 0 if elapsed_s is None or gpus == 0 else math.ceil(gpus * max(0.0, elapsed_s))


def tail(path: Path, max_chars: int = L.TAIL_MAX_CHARS) -> str:
    """The last `max_chars` characters of `path` ("" when absent), decoded with errors="replace"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, OSError):
        return ""
    try:
        size = os.fstat(fd).st_size
        # 4 bytes per character at most in UTF-8; replacement characters stand for single bytes.
        want = max_chars * 4
        start = max(0, size - want)
        data = os.pread(fd, want, start)
    finally:
        os.close(fd)
    text = data.decode("utf-8", errors="replace")
    return text[-max_chars:]


def deliver_artifacts(
    ch: safefs.Channel, job: JobRow, task_dir: Path, max_bytes: int
) -> tuple[tuple[Artifact, ...], tuple[SkippedArtifact, ...]]:
    """Deliver what the wrapper copied out for one task; list the rest with reasons (idempotent)."""
    delivered: list[Artifact] = []
    skipped: list[SkippedArtifact] = []
    logged = {r.path: r for r in jobscript.read_artifact_log(task_dir)}
    base = ChannelPaths.result_dir(job.seq, job.launch, job.task if job.array_size > 1 else None)
    for rel in job.artifacts:
        rec = logged.get(rel)
        if rec is None:
            skipped.append(
                SkippedArtifact(rel, "not collected: the task ended before its artifacts were copied")
            )
            continue
        if rec.status != "copied":
            skipped.append(SkippedArtifact(rel, rec.reason or "skipped by the job wrapper"))
            continue
        parts = rel.split("/")
        try:
            src = W.open_contained(str(task_dir / RunPaths.ARTIFACTS), rel)
        except OSError as e:
            skipped.append(
                SkippedArtifact(rel, f"the copied file is gone from the run directory: {e.strerror}")
            )
            continue
        try:
            dest = ch.delivery_dir(base + tuple(parts[:-1]))
            try:
                size, digest = safefs.copy_atomic_at(dest, parts[-1], src, max_bytes)
            finally:
                os.close(dest)
        except safefs.Refused as e:
            skipped.append(SkippedArtifact(rel, f"could not be delivered into results/: {e}"))
            continue
        except ValueError as e:
            skipped.append(SkippedArtifact(rel, f"could not be delivered into results/: {e}"))
            continue
        finally:
            os.close(src)
        where = "/".join((ChannelPaths.RESULTS, *base, *parts))
        delivered.append(Artifact(path=rel, delivered=where, size=size, sha256=digest))
    return tuple(delivered), tuple(skipped)


def backend_hint(task_dir: Path) -> str | None:
    """The backend's own explanation of how a task ended (Slurm: cancelled outside the kernel, out of memory,
    node failure, ...), when it has one."""
    try:
        return hint_of(task_dir)
    except (OSError, msgspec.DecodeError):
        return None


def task_result(
    job: JobRow,
    task_dir: Path | None,
    elapsed_s: float | None,
    artifacts: tuple[Artifact, ...],
    skipped: tuple[SkippedArtifact, ...],
) -> TaskResult:
    hint: str | None = None
    if task_dir is not None:
        rec = jobscript.read_exit(task_dir)
        if rec is not None:
            hint = backend_hint(task_dir) or outcome(rec).hint
    elif job.state == "CANCELLED":
        hint = HINT_CANCELLED_EARLY
    return TaskResult(
        launch=job.launch,
        task=job.task,
        state=job.state,  # type: ignore[arg-type]  # the store holds lifecycle states only
        job_id=job.job_id,
        exit_code=job.exit_code,
        signal=job.signal,
        elapsed_s=elapsed_s,
        stdout_tail=tail(task_dir / RunPaths.STDOUT) if task_dir is not None else "",
        stderr_tail=tail(task_dir / RunPaths.STDERR) if task_dir is not None else "",
        artifacts=artifacts,
        skipped=skipped,
        why=job.why,
        hint=hint,
    )


def build_wake(
    *,
    sleep_id: str,
    seq: int,
    created_at: str,
    woken_at: str,
    note: str,
    balance: Balance,
    tasks: tuple[TaskResult, ...],
    refunded_gpu_s: int,
    verdict: Verdict | None = None,
) -> Wake:
    return Wake(
        protocol=L.PROTOCOL_VERSION,
        id=sleep_id,
        seq=seq,
        created_at=created_at,
        woken_at=woken_at,
        budget=balance.to_message(),
        note=note,
        tasks=tasks,
        verdict=verdict,
        refunded_gpu_hours=gpu_hours(refunded_gpu_s),
    )
