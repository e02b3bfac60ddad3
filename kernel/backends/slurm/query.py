"""Tracking queries as pure functions: the batched `squeue` and `sacct` commands and the reading of their output.

One `squeue` per poll interval covers every tracked job (never one per job: that is what overloads controllers).
Its answer is read together with its exit status, because the same silence means different things: `squeue -j`
with ONE unknown id exits 1 "Invalid job id" (the job left the queue), with two or more it exits 0; a controller
that does not answer is "unknown", never "gone". `sacct` is asked only about jobs that left the queue without an
exit file, always with `-S` (its default window starts at midnight and ids get reused), and a cluster without
slurmdbd answers "accounting storage is disabled", which is its own outcome, neither an error nor "gone".

Entries are keyed by `(array job id, task index)`; a job that is not an array has task None. Pending array ranges
(`123_[2-7%2]`) are expanded so every task has its own entry.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Final, Literal

from msgspec import Struct

from kernel.backends.slurm.errors import SlurmOutputError
from kernel.backends.slurm.ids import parse_job_id

TaskKey = tuple[str, int | None]

SQUEUE_FORMAT: Final = "%i|%A|%F|%K|%T|%r"
SACCT_FIELDS: Final = ("JobIDRaw", "JobID", "State", "ExitCode", "Elapsed", "Start", "End", "NodeList")
# One argv string may not exceed 128 KiB on Linux (MAX_ARG_STRLEN); past this, list all of our jobs instead.
MAX_ID_LIST_CHARS: Final = 100_000

_DIGITS_RE: Final = re.compile(r"^\d+$")
_CLUSTER_HEADER_RE: Final = re.compile(r"^CLUSTER:\s*(?P<name>\S+)\s*$")
_CLUSTER_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_STATE_RE: Final = re.compile(r"^(?P<state>[A-Z_]+)\+?(?: by (?P<uid>\d+))?$")
_ELAPSED_RE: Final = re.compile(
    r"^(?:(?P<days>\d+)-)?(?:(?P<hours>\d+):)?(?P<minutes>\d+):(?P<seconds>\d+(?:\.\d+)?)$"
)
_INVALID_JOB_RE: Final = re.compile(r"invalid job id", re.I)
_ACCOUNTING_DISABLED_RE: Final = re.compile(r"accounting storage is disabled", re.I)


class SqueueRow(Struct, frozen=True):
    """One task (or job) as `squeue` listed it."""

    job_id: str  # %A: the task's own job id (equals the array job id while a range is still pending)
    array_job_id: str  # %F: the id sbatch returned
    task: int | None
    state: str
    reason: str
    cluster: str | None = None

    @property
    def key(self) -> TaskKey:
        return (self.array_job_id, self.task)


class SacctRow(Struct, frozen=True):
    """One task (or job) as `sacct -X` recorded it."""

    job_id_raw: str
    array_job_id: str
    task: int | None
    state: str
    cancelled_by: int | None
    exit_status: int | None
    signal: int | None
    elapsed_s: float | None
    start: str = ""
    end: str = ""
    nodes: str = ""

    @property
    def key(self) -> TaskKey:
        return (self.array_job_id, self.task)


class SqueueResult(Struct, frozen=True):
    """`known` False: the query failed and says nothing (keep every job as it was). True: a job asked about and
    absent from `entries` has left the queue."""

    known: bool
    entries: dict[TaskKey, SqueueRow]
    detail: str = ""


class SacctResult(Struct, frozen=True):
    status: Literal["ok", "disabled", "unknown"]
    entries: dict[TaskKey, SacctRow]
    detail: str = ""


def _id_list(job_ids: Iterable[str]) -> list[str]:
    ids = sorted(set(job_ids), key=lambda i: (len(i), i))
    if not ids:
        raise ValueError("no job ids to ask about (poll nothing instead of running a query without -j)")
    for i in ids:
        if not _DIGITS_RE.match(i):
            raise ValueError(f"job id {i!r} is not a plain Slurm job id (digits)")
    return ids


_TASK_TARGET_RE: Final = re.compile(r"^[0-9]+(?:_[0-9]+)?$")


def clusters_args(clusters: Iterable[str] | None) -> list[str]:
    """`-M a,b` for jobs sbatch placed on named clusters (`id;cluster`); nothing for the local cluster."""
    names = sorted(set(clusters or ()))
    for name in names:
        if not _CLUSTER_NAME_RE.match(name):
            raise ValueError(f"cluster name {name!r} is not a Slurm cluster name")
    return ["-M", ",".join(names)] if names else []


def squeue_argv(
    job_ids: Iterable[str], squeue: str = "squeue", *, clusters: Iterable[str] | None = None
) -> list[str]:
    """One `squeue` for all of `job_ids` (the ids sbatch returned), array tasks one per line; `clusters` are
    the clusters those jobs were placed on, if sbatch named any."""
    ids = _id_list(job_ids)
    argv = [squeue, *clusters_args(clusters), "-h", "-r", "-t", "all", "-o", SQUEUE_FORMAT]
    joined = ",".join(ids)
    if len(joined) > MAX_ID_LIST_CHARS:
        return [*argv, "--me"]
    return [*argv, "-j", joined]


def squeue_by_name_argv(names: Iterable[str], squeue: str = "squeue") -> list[str]:
    """One `squeue` for our jobs with any of these job names, every state, each line `name|workdir|<format>`
    (`SQUEUE_FORMAT` after the job name and working directory), for finding a launch's job by name."""
    wanted = list(names)
    for name in wanted:
        if not name or "," in name or "|" in name or not name.isprintable():
            raise ValueError(f"job name {name!r} cannot be looked up with squeue --name")
    if not wanted:
        raise ValueError("squeue_by_name_argv needs at least one job name")
    return [squeue, "-h", "-t", "all", "--me", "-o", f"%j|%Z|{SQUEUE_FORMAT}", f"--name={','.join(wanted)}"]


def scancel_argv(
    targets: Iterable[str], scancel: str = "scancel", *, clusters: Iterable[str] | None = None
) -> list[str]:
    """One `scancel` of whole jobs (`123`) and array tasks (`123_4`), with `-M` for the clusters sbatch placed
    them on (the same rule as every query: a job on a named cluster is unknown to the local controller)."""
    ids = list(targets)
    for i in ids:
        if not _TASK_TARGET_RE.match(i):
            raise ValueError(f"{i!r} is not a Slurm job id or array task (123 or 123_4)")
    if not ids:
        raise ValueError("scancel_argv needs at least one job id")
    return [scancel, *clusters_args(clusters), *ids]


def parse_squeue(stdout: str) -> dict[TaskKey, SqueueRow]:
    """Rows of `squeue -h -r -o SQUEUE_FORMAT`, with `CLUSTER: name` headers (`-M`) tolerated."""
    entries: dict[TaskKey, SqueueRow] = {}
    cluster: str | None = None
    for lineno, raw in enumerate(stdout.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        header = _CLUSTER_HEADER_RE.match(line)
        if header:
            cluster = header["name"]
            continue
        fields = line.split("|", 5)
        if len(fields) != 6:
            raise SlurmOutputError(f"squeue line {lineno} has {len(fields)} fields, expected 6: {raw!r}")
        shown, own, array_id, task_field, state, reason = fields
        jid = parse_job_id(shown)
        if not _DIGITS_RE.match(own) or not _DIGITS_RE.match(array_id):
            raise SlurmOutputError(f"squeue line {lineno} has a bad %A or %F: {raw!r}")
        if not state or not state.replace("_", "").isalpha():
            raise SlurmOutputError(f"squeue line {lineno} has a bad state {state!r}: {raw!r}")
        if jid.tasks is None and task_field not in ("N/A", ""):
            # %K names a task but %i did not (unexpected formats): trust %K.
            jid = parse_job_id(f"{array_id}_[{task_field}]")
        tasks: tuple[int | None, ...] = (None,) if jid.tasks is None else jid.tasks
        for task in tasks:
            row = SqueueRow(
                job_id=own,
                array_job_id=array_id,
                task=task,
                state=state.upper(),
                reason=reason.strip(),
                cluster=cluster or jid.cluster,
            )
            entries[row.key] = row
    return entries


def read_squeue(returncode: int, stdout: str, stderr: str, job_ids: Iterable[str]) -> SqueueResult:
    """What one run of `squeue_argv(job_ids)` tells: known entries, or nothing at all."""
    ids = set(job_ids)
    if returncode != 0:
        if len(ids) == 1 and _INVALID_JOB_RE.search(stderr):
            return SqueueResult(known=True, entries={}, detail="the one job asked about is no longer known")
        return SqueueResult(
            known=False, entries={}, detail=_first_line(stderr) or f"squeue exited {returncode}"
        )
    try:
        return SqueueResult(known=True, entries=parse_squeue(stdout))
    except SlurmOutputError as e:
        return SqueueResult(known=False, entries={}, detail=str(e))


def sacct_argv(
    job_ids: Iterable[str],
    since: datetime,
    sacct: str = "sacct",
    *,
    clusters: Iterable[str] | None = None,
) -> list[str]:
    """One `sacct` for `job_ids`, looking back to `since` (the earliest submit time among them).

    Slurm reads `-S` in the cluster's local time: an aware `since` is converted to local time.
    """
    ids = _id_list(job_ids)
    start = (since.astimezone() if since.tzinfo else since).strftime("%Y-%m-%dT%H:%M:%S")
    return [
        sacct,
        *clusters_args(clusters),
        "-X",
        "-P",
        "-n",
        "-j",
        ",".join(ids),
        "-S",
        start,
        "-o",
        ",".join(SACCT_FIELDS),
    ]


def parse_state(text: str) -> tuple[str, int | None]:
    """`CANCELLED by 0` -> ("CANCELLED", 0); `COMPLETED` -> ("COMPLETED", None)."""
    m = _STATE_RE.match(text.strip())
    if m is None:
        raise SlurmOutputError(f"not a Slurm job state: {text!r}")
    return m["state"], int(m["uid"]) if m["uid"] else None


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """`ExitCode` is `status:signal` (`0:125` is how some sites record an OOM kill); empty -> (None, None)."""
    t = text.strip()
    if not t:
        return None, None
    status, sep, sig = t.partition(":")
    if not sep or not status.isdigit() or not sig.isdigit():
        raise SlurmOutputError(f"ExitCode {text!r} is not `status:signal`")
    return int(status), int(sig)


def parse_elapsed(text: str) -> float | None:
    """Slurm durations `[D-][HH:]MM:SS[.fff]` in seconds; `INVALID`, `UNLIMITED`, `Unknown` or empty -> None."""
    t = text.strip()
    if t.upper() in ("", "INVALID", "UNLIMITED", "UNKNOWN", "N/A", "NONE"):
        return None
    m = _ELAPSED_RE.match(t)
    if m is None:
        raise SlurmOutputError(f"not a Slurm duration: {text!r}")
    return (
        int(m["days"] or 0) * 86400
        + int(m["hours"] or 0) * 3600
        + int(m["minutes"]) * 60
        + float(m["seconds"])
    )


def parse_sacct(stdout: str) -> dict[TaskKey, SacctRow]:
    """Rows of `sacct -X -P -n -o SACCT_FIELDS`; for a job listed twice (requeued) the last row wins."""
    entries: dict[TaskKey, SacctRow] = {}
    for lineno, raw in enumerate(stdout.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        fields = line.split("|")
        if len(fields) != len(SACCT_FIELDS):
            raise SlurmOutputError(
                f"sacct line {lineno} has {len(fields)} fields, expected {len(SACCT_FIELDS)}: {raw!r}"
            )
        raw_id, shown, state_text, exit_text, elapsed_text, start, end, nodes = fields
        if not _DIGITS_RE.match(raw_id):
            raise SlurmOutputError(f"sacct line {lineno} has a bad JobIDRaw {raw_id!r}: {raw!r}")
        jid = parse_job_id(shown)
        state, by = parse_state(state_text)
        status, sig = parse_exit_code(exit_text)
        elapsed = parse_elapsed(elapsed_text)
        tasks: tuple[int | None, ...] = (None,) if jid.tasks is None else jid.tasks
        for task in tasks:
            row = SacctRow(
                job_id_raw=raw_id,
                array_job_id=jid.base,
                task=task,
                state=state,
                cancelled_by=by,
                exit_status=status,
                signal=sig,
                elapsed_s=elapsed,
                start=start,
                end=end,
                nodes=nodes,
            )
            entries[row.key] = row
    return entries


def read_sacct(returncode: int, stdout: str, stderr: str) -> SacctResult:
    """What one run of `sacct_argv(...)` tells: rows, "accounting is disabled here", or nothing ("unknown")."""
    if _ACCOUNTING_DISABLED_RE.search(stderr) or _ACCOUNTING_DISABLED_RE.search(stdout):
        return SacctResult(status="disabled", entries={}, detail="accounting storage is disabled")
    if returncode != 0:
        return SacctResult(
            status="unknown", entries={}, detail=_first_line(stderr) or f"sacct exited {returncode}"
        )
    try:
        return SacctResult(status="ok", entries=parse_sacct(stdout))
    except SlurmOutputError as e:
        return SacctResult(status="unknown", entries={}, detail=str(e))


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


# --- `syscall-kernel check`: does Slurm know the configured names? ---------------------------------------------


def partition_argv(partition: str, scontrol: str = "scontrol") -> list[str]:
    """`scontrol show partition NAME` (exit 0 and one record when the partition exists)."""
    return [scontrol, "show", "--oneliner", "partition", partition]


def sacctmgr_argv(kind: Literal["account", "qos"], name: str, sacctmgr: str = "sacctmgr") -> list[str]:
    """`sacctmgr show account|qos NAME`, one parsable line per match (none: Slurm does not know it)."""
    field = "account" if kind == "account" else "name"
    return [sacctmgr, "--noheader", "--parsable2", "show", kind, name, f"format={field}"]


def ping_argv(scontrol: str = "scontrol") -> list[str]:
    """`scontrol ping`: exit 0 when the controller answers."""
    return [scontrol, "ping"]


# What the clients print when they find no controller to ask at all: no slurm.conf, and no DNS SRV record
# (configless Slurm) naming one.
NO_CONFIG_SOURCE: Final = "Could not establish a configuration source"
