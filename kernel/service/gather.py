"""What a finished task left in its run directory, turned into the wake's evidence.

- `outcome`: an `exit-code` record -> the task's lifecycle event, final state, exit code, signal and hint.
- `scan_log`, `tail`: a log's size and line count, its last whole lines (`TAIL_MAX_LINES`, `TAIL_MAX_BYTES`), and the
  last line of stdout that is a JSON object; `deliver_log` copies the log (its end, over `log_max_bytes`) into
  `results/` through `safefs`.
- `deliver_artifacts`: copy the artifacts the wrapper copied out of the job's tree into the channel's
  `results/<seq>/<launch>[/<task>]/`, through `safefs` only (a level swapped for a symlink by the agent is
  refused, never followed), each listed with the size and sha256 of the bytes actually delivered; every artifact
  not delivered is listed with its reason.
- `build_wake`: the `Wake` message of a sleep from its task results and the budget after refunds.

Everything here is plain blocking I/O on kernel-owned files and one channel fd, so it never runs in a store step
(kernel.io.stepguard): in the heavy pool, the channel I/O pool (`read_tail`) or a plain thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

import msgspec

from channel import limits as L
from channel import safefs, sweep
from channel.lifecycle import STOPPED_TASK_STATES
from channel.messages import (
    Artifact,
    ErrorInfo,
    JobRef,
    LaunchSummary,
    LogFile,
    SkippedArtifact,
    TaskResult,
    Verdict,
    Wake,
    WakePart,
)
from channel.paths import ChannelPaths, RunPaths
from kernel.backends import jobscript
from kernel.core import exits, rules
from kernel.core.budget import Balance, gpu_hours
from kernel.core.exits import HINT_CANCELLED_EARLY, HINT_FAILED, Outcome, import_hint
from kernel.core.records import JobRow, SleepRow
from kernel.node import wrapper as W

# The backend's explanation of a task's end (`Backend.hint_of`), and its reading of the end (`Backend.outcome_of`).
HintOf = Callable[[Path], str | None]
OutcomeOf = Callable[[Path], Outcome | None]


def outcome(rec: jobscript.ExitRecord) -> Outcome:
    """The task's end as the lifecycle and the wake see it (pure: `kernel.core.exits`)."""
    return exits.outcome(rec.kind, rec.code, rec.signal, detail=rec.detail)


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


def cut_tail(body: bytes, max_lines: int) -> bytes:
    """The last `max_lines` lines of `body` (a last line without a newline counts as a line)."""
    pos = len(body) - 1 if body.endswith(b"\n") else len(body)
    for _ in range(max_lines):
        pos = body.rfind(b"\n", 0, pos)
        if pos < 0:
            return body
    return body[pos + 1 :]


def count_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def tail_of_fd(
    fd: int, size: int, max_lines: int = L.TAIL_MAX_LINES, max_bytes: int = L.TAIL_MAX_BYTES
) -> bytes:
    """The last whole lines of the first `size` bytes of `fd`: at most `max_lines` lines and `max_bytes` bytes.

    The tail starts at a line boundary, except when the last line alone is longer than `max_bytes`: then it is
    that line's last `max_bytes` bytes (the marker in the wake says how much was cut either way)."""
    start = max(0, size - max_bytes - 1)
    window = os.pread(fd, size - start, start)
    body = window
    if start > 0:
        before, body = window[:1], window[1:]
        if before != b"\n":
            cut = body.find(b"\n")
            if 0 <= cut < len(body) - 1:
                body = body[cut + 1 :]
    return cut_tail(body, max_lines)


def last_json_object(data: bytes) -> str | None:
    """The last line of `data` that is a JSON object (how a job reports its result), as printed, or None."""
    for raw in reversed(data.split(b"\n")):
        line = raw.strip()
        if not (line.startswith(b"{") and line.endswith(b"}")):
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # job-written: nested deeper than the parser recurses
            continue
        if isinstance(value, dict):
            text = line.decode("utf-8", errors="replace")
            return text if len(text) <= L.RESULT_MAX_CHARS else None
    return None


# How far back from the end of stdout a job's result line is looked for.
RESULT_WINDOW: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class LogScan:
    """A finished task's stdout or stderr, read once: size, line count, its tail and (stdout) its result line."""

    size: int
    lines: int
    tail: str
    tail_bytes: int
    tail_lines: int
    result: str | None


def scan_log(path: Path) -> LogScan | None:
    """Read a kernel-owned log (never through a symlink); None when absent or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        size = st.st_size
        lines, offset = 0, 0
        last = b""
        while offset < size:
            chunk = os.pread(fd, min(1 << 20, size - offset), offset)
            if not chunk:
                break
            lines += chunk.count(b"\n")
            offset += len(chunk)
            last = chunk[-1:]
        size = offset  # what was there to read
        if size and last != b"\n":
            lines += 1
        tail = tail_of_fd(fd, size)
        result = last_json_object(os.pread(fd, min(size, RESULT_WINDOW), size - min(size, RESULT_WINDOW)))
    finally:
        os.close(fd)
    return LogScan(
        size=size,
        lines=lines,
        tail=tail.decode("utf-8", errors="replace"),
        tail_bytes=len(tail),
        tail_lines=count_lines(tail),
        result=result,
    )


def tail(path: Path, max_lines: int = L.TAIL_MAX_LINES, max_bytes: int = L.TAIL_MAX_BYTES) -> str:
    """The last whole lines of `path` ("" when absent), decoded with errors="replace"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        return tail_of_fd(fd, st.st_size, max_lines, max_bytes).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class LiveTail:
    """A (possibly running) task's output so far, as `tail` answers it."""

    text: str
    lines: int
    size: int
    cut: bool


def read_tail(task_file: Path | None, lines: int, max_bytes: int = L.TAIL_VERB_MAX_BYTES) -> LiveTail:
    """The last `lines` whole lines of a task's log so far (at most `max_bytes`), never through a symlink; an
    absent log (the task has not started) is empty. Reads at most `max_bytes + 1` bytes whatever the log's size,
    so answering it stays cheap on the request path."""
    if task_file is None:
        return LiveTail("", 0, 0, False)
    try:
        fd = os.open(task_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return LiveTail("", 0, 0, False)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return LiveTail("", 0, 0, False)
        data = tail_of_fd(fd, st.st_size, lines, max_bytes)
    finally:
        os.close(fd)
    return LiveTail(
        data.decode("utf-8", errors="replace"), count_lines(data), st.st_size, len(data) < st.st_size
    )


def deliver_log(
    ch: safefs.Channel, job: JobRow, task_dir: Path, name: str, scan: LogScan | None, max_bytes: int
) -> LogFile | None:
    """Copy a task's `stdout` or `stderr` into `results/<seq>/<launch>[/<task>]/<name>` (its last `max_bytes`,
    from a line boundary, when it is longer), through safefs; the LogFile says what was delivered or why not."""
    if scan is None:
        return None
    base = ChannelPaths.result_dir(job.seq, job.launch, job.task if job.array_size > 1 else None)
    log = LogFile(size=scan.size, lines=scan.lines, tail_bytes=scan.tail_bytes, tail_lines=scan.tail_lines)
    try:
        src = os.open(task_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return msgspec.structs.replace(log, reason=f"the log is gone from the run directory: {e.strerror}")
    try:
        start = 0
        if scan.size > max_bytes:
            start = scan.size - max_bytes
            head = os.pread(src, min(RESULT_WINDOW, max_bytes), start)
            cut = head.find(b"\n")
            if 0 <= cut < len(head) - 1:
                start += cut + 1
        dest = ch.delivery_dir(base)
        try:
            _size, digest = safefs.copy_atomic_at(dest, name, src, scan.size - start, offset=start)
        finally:
            os.close(dest)
    except (safefs.Refused, ValueError, OSError) as e:
        return msgspec.structs.replace(log, reason=f"could not be delivered into results/: {e}")
    finally:
        os.close(src)
    where = "/".join((ChannelPaths.RESULTS, *base, name))
    return msgspec.structs.replace(log, delivered=where, delivered_from=start, sha256=digest)


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


def end_hint(task_dir: Path, hint_of: HintOf, outcome_of: OutcomeOf | None = None) -> str | None:
    """The hint of a task's end as its run directory shows it: the backend's own explanation, else the hint of the
    end the backend reads (`outcome_of`: the row of the state the task was recorded with), else the exit record's
    row; None when no end is recorded there."""
    # The backend's reading first: it also knows an end it could not write down (a full disk).
    read = None if outcome_of is None else outcome_of(task_dir)
    if read is None and (rec := jobscript.read_exit(task_dir)) is not None:
        read = outcome(rec)
    if read is None:
        return None
    return backend_hint(task_dir, hint_of) or read.hint


@dataclass(frozen=True, slots=True)
class TaskFiles:
    """What was delivered of one task: its artifacts (and those skipped) and its two logs; and the hint of its end
    (`end_hint`), read from its run directory with them."""

    artifacts: tuple[Artifact, ...] = ()
    skipped: tuple[SkippedArtifact, ...] = ()
    stdout: LogScan | None = None
    stderr: LogScan | None = None
    stdout_log: LogFile | None = None
    stderr_log: LogFile | None = None
    hint: str | None = None


def deliver_task(
    ch: safefs.Channel, job: JobRow, task_dir: Path, artifact_max_bytes: int, log_max_bytes: int
) -> TaskFiles:
    """Deliver a finished task's artifacts and logs into the channel (idempotent)."""
    arts, skipped = deliver_artifacts(ch, job, task_dir, artifact_max_bytes)
    out, err = scan_log(task_dir / RunPaths.STDOUT), scan_log(task_dir / RunPaths.STDERR)
    return TaskFiles(
        artifacts=arts,
        skipped=skipped,
        stdout=out,
        stderr=err,
        stdout_log=deliver_log(ch, job, task_dir, RunPaths.STDOUT, out, log_max_bytes),
        stderr_log=deliver_log(ch, job, task_dir, RunPaths.STDERR, err, log_max_bytes),
    )


def task_result(
    job: JobRow,
    task_dir: Path | None,
    elapsed_s: float | None,
    files: TaskFiles,
    environment_mode: str = "none",
    memory: tuple[int | None, int] | None = None,
) -> TaskResult:
    """The task as the wake shows it (pure: its files were read already, so this runs in a store step); its hint
    is its end's (`files.hint`), a task never handed over (`task_dir` None) that was cancelled has the hint of
    that, and a plain failure whose stderr shows a missing import gets that import's hint (`environment_mode`:
    what the kernel builds jobs' environments from). A task killed for its memory gets the hint of its limit and
    how to ask for more (`memory`: the default limit of a task that asked for none, and the workspace's
    `max_mem_mb`; without it, the end's own hint); a submit's evaluation run stopped at its walltime, the hint
    of the submit's `eval_minutes` (no launch declared it). The artifacts of a task stopped before its command ended
    (STOPPED_TASK_STATES) are delivered all the same, marked partial."""
    hint = files.hint
    if job.state == "OUT_OF_MEMORY" and memory is not None:
        default_mb, max_mem_mb = memory
        hint = (
            exits.eval_oom_hint(job.mem_mb or default_mb)
            if job.launch in L.EVAL_LAUNCH_NAMES
            else exits.oom_hint(job.mem_mb or default_mb, job.mem_mb, max_mem_mb)
        )
    if job.state == "TIMEOUT" and job.launch in L.EVAL_LAUNCH_NAMES and hint is None:
        hint = exits.eval_timeout_hint(job.minutes)
    if task_dir is None:
        hint = HINT_CANCELLED_EARLY if job.state == "CANCELLED" else None
    if hint == HINT_FAILED and files.stderr is not None:
        hint = (
            import_hint(files.stderr.tail, environment_mode)
            or exits.not_found_hint(job.exit_code, files.stderr.tail)
            or hint
        )
    hint = exits.output_hint(
        hint, files.stdout.tail if files.stdout else "", files.stderr.tail if files.stderr else ""
    )
    return TaskResult(
        launch=job.launch,
        task=job.task,
        state=job.state,
        job_id=job.job_id,
        exit_code=job.exit_code,
        signal=job.signal,
        elapsed_s=elapsed_s,
        stdout_tail=files.stdout.tail if files.stdout else "",
        stderr_tail=files.stderr.tail if files.stderr else "",
        artifacts=tuple(msgspec.structs.replace(a, partial=True) for a in files.artifacts)
        if job.state in STOPPED_TASK_STATES
        else files.artifacts,
        skipped=files.skipped,
        why=job.why,
        hint=hint,
        stdout_log=files.stdout_log,
        stderr_log=files.stderr_log,
        result=files.stdout.result if files.stdout else None,
        params=dict(job.params) if job.params else None,
    )


def launch_summaries(
    jobs: list[JobRow],
    shown: tuple[TaskResult, ...],
    max_concurrent_gpus: int,
    names: tuple[TaskResult, ...] | None = None,
) -> tuple[LaunchSummary, ...]:
    """One summary per launch the wake shows (`names`, default `shown`), in the order shown
    (rules.launch_summaries: `status` says the same); a ranked launch's with its tasks of `shown` best first
    (channel.sweep.rank)."""
    by_name = {x.name: x for x in rules.launch_summaries(jobs, max_concurrent_gpus)}
    out = []
    for name in dict.fromkeys(t.launch for t in (shown if names is None else names)):
        if (x := by_name.get(name)) is None:
            continue
        if x.rank is not None:
            tasks = [(t.task, t.result) for t in shown if t.launch == name]
            x = msgspec.structs.replace(x, ranking=sweep.rank(tasks, x.rank))
        out.append(x)
    return tuple(out)


def build_wake(
    sleep: SleepRow,
    *,
    woken_at: str,
    balance: Balance,
    tasks: tuple[TaskResult, ...],
    refunded_gpu_s: int,
    snapshot: str | None,
    launches: tuple[LaunchSummary, ...] = (),
    verdict: Verdict | None = None,
    error: ErrorInfo | None = None,
    part: WakePart = "whole",
    trigger: JobRef | None = None,
    rest_tasks: tuple[JobRef, ...] = (),
) -> Wake:
    """`sleep`'s wake (its whole one, its early one or its rest: `part`), as recorded and written."""
    return Wake(
        protocol=L.PROTOCOL_VERSION,
        id=sleep.id,
        seq=sleep.seq,
        created_at=sleep.created_at,
        woken_at=woken_at,
        budget=balance.to_message(),
        note=sleep.note,
        tasks=tasks,
        verdict=verdict,
        refunded_gpu_hours=gpu_hours(refunded_gpu_s),
        snapshot=snapshot or None,
        launches=launches,
        error=error,
        wake_on=sleep.wake_on,
        rest=sleep.rest,
        part=part,
        trigger=trigger,
        rest_tasks=rest_tasks,
    )


def job_order(job_id: str) -> tuple[int, str]:
    """Job ids in submission order for log lines (numeric where they are: `99` before `100`)."""
    head = job_id.split("_")[0].split(".")[0]
    return (int(head) if head.isdigit() else 0, job_id)
