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
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import msgspec

from channel import limits as L
from channel import safefs
from channel.messages import Artifact, SkippedArtifact, TaskResult, Verdict, Wake
from channel.paths import ChannelPaths, RunPaths
from kernel.backends import jobscript
from kernel.core import exits
from kernel.core.budget import Balance, gpu_hours
from kernel.core.exits import HINT_CANCELLED_EARLY, Outcome
from kernel.core.records import JobRow
from kernel.node import wrapper as W

# The backend's explanation of a task's end (`Backend.hint_of`).
HintOf = Callable[[Path], str | None]


def outcome(rec: jobscript.ExitRecord) -> Outcome:
    """The task's end as the lifecycle and the wake see it (pure: `kernel.core.exits`)."""
    return exits.outcome(rec.kind, rec.code, rec.signal)


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


def backend_hint(task_dir: Path, hint_of: HintOf) -> str | None:
    """The backend's own explanation of how a task ended (`Backend.hint_of`; Slurm: cancelled outside the kernel,
    out of memory, node failure, ...), when it has one."""
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
    hint_of: HintOf,
) -> TaskResult:
    hint: str | None = None
    if task_dir is not None:
        rec = jobscript.read_exit(task_dir)
        if rec is not None:
            hint = backend_hint(task_dir, hint_of) or outcome(rec).hint
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
