"""The pipeline's decisions, as pure functions of recorded state (no I/O, no clock: `now` is passed in).

- `accept_sleep`: policy, the sleeps in flight (`max_sleeps_in_flight`, one submit, the GPUs they hold), and
  budget -> the charged balance and the tasks to record (with a submit, its two evaluation runs too:
  `kernel.core.evaluate.eval_jobs`), each with its launch's width: how many of its tasks run at once, the GPU
  launches sharing what `max_concurrent_gpus` leaves (`share_gpus`), decided once and recorded.
- `plan_cancel`: which sleep and which of its live tasks a cancel names, and the balance after refunding those
  never submitted.
- `status_target`, `tail_target`: the sleep a `status` shows and the task a `tail` reads.
- `status_answer`, `queue_answer`, `history_answer`: the read-only answers, built from store rows.
- `plan_pass`: which workspaces get how many requests in one pass (bounded, round-robin, so that one flooding
  channel cannot starve the others).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Final

import msgspec

from channel import limits as L
from channel import sweep
from channel.decode import RequestError, at_a_time, check_policy, clamp_note, count_of
from channel.lifecycle import (
    LIVE_TASK_STATES,
    SLEEP_OVER_FOR_AGENT,
    SLEEP_WOKEN_EARLY,
    TERMINAL_TASK_STATES,
)
from channel.messages import (
    CancelRequest,
    EnvironmentBuild,
    HistoryAnswer,
    HistoryEntry,
    HistoryLaunch,
    JobRef,
    KernelRef,
    LaunchSummary,
    MetricBest,
    ProgressFile,
    QueueAnswer,
    QueueEntry,
    SleepBrief,
    SleepRequest,
    SleepView,
    StatusAnswer,
    StatusRequest,
    TailRequest,
    TaskProgress,
    TaskView,
)
from channel.paths import CHANNEL_DIR, ChannelPaths, RunPaths
from kernel.core import ledger
from kernel.core.budget import Balance
from kernel.core.evaluate import eval_jobs
from kernel.core.records import JobRow, SleepRow, WorkspaceRow


class _StoredOutcome(msgspec.Struct):
    """The outcome and the two values of a stored verdict (other members ignored: a verdict stored by an older
    kernel, with its since-removed `seed`, still shows in history)."""

    outcome: str
    base_value: float | None = None
    candidate_value: float | None = None


_verdict_decoder: Final = msgspec.json.Decoder(_StoredOutcome)


def parse_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def elapsed(job: JobRow, now: float) -> float | None:
    if job.started_at is None:
        return None
    end = parse_time(job.ended_at) if job.ended_at else now
    return round(max(0.0, end - parse_time(job.started_at)), 3)


# --- sleep and cancel ------------------------------------------------------------------------------------


# A sleep and its tasks as read for a decision (a sleep in flight, or one a request names).
Sleep = tuple[SleepRow, Sequence[JobRow]]


def named_sleeps(sleeps: Sequence[Sleep]) -> str:
    """'a' (seq 3), 'b' (seq 4; woke early, 2 tasks still running): sleeps as a message names them."""
    return ", ".join(_named(s, jobs) for s, jobs in sleeps)


def _named(s: SleepRow, jobs: Sequence[JobRow]) -> str:
    if s.state in SLEEP_WOKEN_EARLY:
        running = sum(1 for j in jobs if j.state in LIVE_TASK_STATES)
        if not running:  # its rest has ended and is being gathered: the rest wake comes now
            return f"{s.id!r} (seq {s.seq}; woke early, and its rest wake is being written)"
        return f"{s.id!r} (seq {s.seq}; woke early, {count_of(running, 'task')} of it still running)"
    return f"{s.id!r} (seq {s.seq})"


# What a refusal adds when a sleep it names woke early: it is in flight until its rest has ended.
EARLY_IN_FLIGHT: Final = (
    " (a sleep that woke early stays in flight until the tasks it left running have ended: its rest wake, "
    "`wakes/<id>.rest.md`, comes then; cancel them to end it sooner)"
)


def width_of(job: JobRow, max_concurrent_gpus: int) -> int:
    """How many tasks of `job`'s launch run at once: the width recorded at acceptance (accept_sleep), or for a
    task an older kernel recorded without one, `at_a_time` under the ceiling now, as that kernel decided it."""
    if job.width is not None:
        return job.width
    return at_a_time(job.array_size, job.concurrency, job.gpus, max_concurrent_gpus)


def array_throttle(job: JobRow, max_concurrent_gpus: int) -> int:
    """What a backend is told of `job`'s launch (JobSpec.concurrency, Slurm's `--array=0-N%K`): its width, or 0
    (no throttle) when the whole array runs at once."""
    width = width_of(job, max_concurrent_gpus)
    return 0 if width >= job.array_size else width


def gpus_at_once(jobs: Sequence[JobRow], max_concurrent_gpus: int) -> int:
    """The most GPUs `jobs` can hold at once: per launch, the tasks that run together (`width_of`, and no more
    than are still live) times the GPUs each takes."""
    live: dict[str, list[JobRow]] = {}
    for j in jobs:
        if j.gpus > 0 and j.state in LIVE_TASK_STATES:
            live.setdefault(j.launch, []).append(j)
    return sum(min(len(ts), width_of(ts[0], max_concurrent_gpus)) * ts[0].gpus for ts in live.values())


def share_gpus(gpus_left: int, launches: Sequence[tuple[int, int]]) -> tuple[int, ...] | None:
    """How many tasks of each GPU launch run at once when the launches share `gpus_left` GPUs: `launches` are
    (GPUs per task, the most tasks it would run at once: its concurrency, or its array), in order. Each gets one
    task first; then, round robin in order, one more task to each launch that would run more and whose task
    still fits, until none does. None when one task of each does not fit. The widths' GPUs never exceed
    `gpus_left`, and no launch gets more than its most."""
    widths = [1] * len(launches)
    left = gpus_left - sum(g for g, _ in launches)
    if left < 0:
        return None
    grew = True
    while grew:
        grew = False
        for i, (g, most) in enumerate(launches):
            if widths[i] < most and g <= left:
                widths[i] += 1
                left -= g
                grew = True
    return tuple(widths)


def _one_task_of_each(launches: int) -> str:
    if launches == 1:
        return "one task of this sleep's GPU launch"
    return f"one task of each of this sleep's {launches} GPU launches at once"


def _with_widths(
    jobs: tuple[JobRow, ...], in_flight: Sequence[Sleep], ws: WorkspaceRow
) -> tuple[JobRow, ...]:
    """`jobs` (a new sleep's) with each launch's width: a launch without GPUs runs its concurrency (or its whole
    array); the GPU launches share what the ceiling leaves beside what the sleeps in flight may hold
    (`share_gpus`). RequestError(sleep.in_progress) when that leaves too few for one task of each: the sleep
    alone fits (check_policy refused it otherwise), so it fits once sleeps in flight end."""
    cap = ws.policy.max_concurrent_gpus
    first: dict[str, JobRow] = {}
    for j in jobs:
        first.setdefault(j.launch, j)
    gpu = [j for j in first.values() if j.gpus > 0]
    held = sum(gpus_at_once(tasks, cap) for _, tasks in in_flight)
    shared = share_gpus(
        max(0, cap - held), [(j.gpus, min(j.concurrency or j.array_size, j.array_size)) for j in gpu]
    )
    if shared is None:
        need = sum(j.gpus for j in gpu)
        assert need <= cap, (need, cap)  # check_policy's policy.concurrent_gpus
        assert held > 0, (held, need, cap)
        holding = [x for x in in_flight if gpus_at_once(x[1], cap) > 0]
        raise RequestError(
            "sleep.in_progress",
            f"the {count_of(len(holding), 'sleep')} in flight holding GPUs ({named_sleeps(holding)}) may hold "
            f"{count_of(held, 'GPU')} at once, leaving {max(0, cap - held)} of this workspace's "
            f"max_concurrent_gpus ({cap}), and {_one_task_of_each(len(gpu))} needs {need}; wait for a wake (or "
            "cancel a sleep's launches), or launch with fewer GPUs per task",
            None,
        )
    widths = {j.launch: w for j, w in zip(gpu, shared, strict=True)}
    return tuple(
        replace(j, width=widths.get(j.launch, min(j.concurrency or j.array_size, j.array_size))) for j in jobs
    )


@dataclass(frozen=True, slots=True)
class Acceptance:
    balance: Balance
    jobs: tuple[JobRow, ...]


SUBMIT_WINDOW_S: Final = 24 * 3600


def submit_window_start(now: str) -> str:
    """The start of the 24 hours before `now` that `max_submits_per_day` counts submits in."""
    return timestamp_of(parse_time(now) - SUBMIT_WINDOW_S)


def timestamp_of(t: float) -> str:
    """`t` as the protocol's RFC 3339 UTC timestamp with milliseconds (parse_time's inverse)."""
    ms = round(t * 1000)
    return datetime.fromtimestamp(ms // 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"


def accept_sleep(
    ws: WorkspaceRow,
    in_flight: Sequence[Sleep],
    req: SleepRequest,
    seq: int,
    now: str,
    submits: tuple[int, str | None] = (0, None),
) -> Acceptance:
    """Decide a sleep: RequestError (nothing charged) or the charged balance and the PENDING tasks to record.
    `in_flight`: the workspace's sleeps in flight (not yet gathered) with their tasks, oldest first. `submits`:
    how many sleeps carrying a submit that count were accepted since `submit_window_start(now)` (one woken with
    no verdict, none of its runs run, does not: Store.submits_since), and the oldest's `created_at`.

    Cheap refusals in the spec's order: policy, then kernel state, then budget.
    """
    check_policy(req, ws.policy)
    assert all(s.state not in SLEEP_OVER_FOR_AGENT for s, _ in in_flight), in_flight
    limit = ws.policy.max_sleeps_in_flight
    if len(in_flight) >= limit:
        raise RequestError(
            "sleep.in_progress",
            f"already {count_of(len(in_flight), 'sleep')} in flight (max_sleeps_in_flight {limit}): "
            f"{named_sleeps(in_flight)}; wait for a wake, or cancel a sleep's launches"
            + (EARLY_IN_FLIGHT if any(x.state in SLEEP_WOKEN_EARLY for x, _ in in_flight) else ""),
            None,
        )
    if req.submit is not None:
        for s, _ in in_flight:
            if s.submit is not None:
                raise RequestError(
                    "sleep.in_progress",
                    f"sleep {s.id!r} (seq {s.seq}), in flight, carries a submit; one submit at a time (wait for "
                    "its wake and its verdict, then submit again; a sleep without `submit` can be now)",
                    "$.submit",
                )
    evals = (
        eval_jobs(ws.policy.submit, req.submit, ws.key, seq, now)
        if req.submit is not None and ws.policy.submit is not None
        else ()
    )
    jobs = _with_widths(_launch_jobs(ws, req, seq, now) + evals, in_flight, ws)
    bound = ws.policy.max_submits_per_day
    if req.submit is not None and bound and submits[0] >= bound:
        oldest = submits[1] or now
        raise RequestError(
            "budget.submits_per_day",
            f"this workspace may have at most {bound} submits accepted in any 24 hours, and {submits[0]} counting "
            f"toward it were accepted since {oldest}; the next can be accepted from "
            f"{timestamp_of(parse_time(oldest) + SUBMIT_WINDOW_S)} (a sleep without `submit` can be now)",
            "$.submit",
        )
    charged = ledger.reserve_sleep(ws.balance, req.launches)
    if evals:
        # The submit's two evaluation runs are job rows of the sleep, their GPU time reserved like a launch's.
        charged = ledger.reserve_eval(charged, evals)
    return Acceptance(balance=charged, jobs=jobs)


def _launch_jobs(ws: WorkspaceRow, req: SleepRequest, seq: int, now: str) -> tuple[JobRow, ...]:
    """The PENDING tasks of the sleep's launches, one per array index."""
    grids = {launch.name: sweep.grid(launch.sweep) for launch in req.launches}
    return tuple(
        JobRow(
            workspace=ws.key,
            seq=seq,
            launch=launch.name,
            task=task,
            array_size=launch.array,
            concurrency=launch.concurrency,
            command=launch.command,
            minutes=launch.minutes,
            gpus=launch.gpus,
            artifacts=launch.artifacts,
            why=launch.why,
            reserved_gpu_s=ledger.task_reservation(launch.gpus, launch.minutes),
            state="PENDING",
            updated_at=now,
            mem_mb=launch.mem_mb,
            cpus=launch.cpus,
            params=grids[launch.name][task] if launch.sweep else (),
            rank=launch.rank,
        )
        for launch in req.launches
        for task in range(launch.array)
    )


@dataclass(frozen=True, slots=True)
class CancelPlan:
    sleep: SleepRow
    # Every live task the cancel names (the answer lists them).
    targets: tuple[JobRow, ...]
    # Those never handed to a backend, as read: the caller moves them PENDING -> CANCELLED (TaskEvent.CANCEL) in
    # the transaction that records `balance`, which has their reservations refunded in full.
    now_cancelled: tuple[JobRow, ...]
    balance: Balance


def _cancel_target(in_flight: Sequence[Sleep], named: Sleep | None, req: CancelRequest) -> Sleep:
    """The sleep a cancel names (`named`: the workspace's sleep of the id `req.sleep`, if it has one), or without
    an id the one sleep in flight (with launch names: the one sleep in flight that has them all)."""
    if req.sleep is not None:
        if named is None:
            flying = named_sleeps(in_flight) or "none"
            raise RequestError(
                "cancel.unknown_sleep",
                f"this workspace has no sleep {req.sleep!r} (in flight: {flying})",
                "$.sleep",
            )
        s = named[0]
        if s.state in SLEEP_OVER_FOR_AGENT:
            # a gathered sleep's wake may already be read: it is over, as for the next sleep (accept_sleep)
            what = "was refused" if s.state == "rejected" else "has woken"
            raise RequestError(
                "cancel.no_sleep",
                f"sleep {s.id!r} (seq {s.seq}) {what}; nothing of it is left to cancel",
                "$.sleep",
            )
        return named
    if not in_flight:
        raise RequestError("cancel.no_sleep", "there is no sleep in flight to cancel", None)
    if len(in_flight) == 1:
        return in_flight[0]
    having = [x for x in in_flight if set(req.launches) <= {j.launch for j in x[1]}] if req.launches else []
    if len(having) == 1:
        return having[0]
    which = (
        ""
        if not req.launches
        else " with all of these launches"
        if having
        else ", none with all of these launches"
    )
    raise RequestError(
        "cancel.which_sleep",
        f"{len(in_flight)} sleeps are in flight{which}: {named_sleeps(having or in_flight)}; name the one to "
        "cancel (`sleep`: its id)",
        None,
    )


def plan_cancel(
    ws: WorkspaceRow, in_flight: Sequence[Sleep], named: Sleep | None, req: CancelRequest
) -> CancelPlan:
    """What a cancel does: the sleep it names (`named`: the workspace's sleep of the id `req.sleep`, if it has
    one; without an id, the one in `in_flight`), the live tasks of it it names, those never handed to a backend,
    and the balance after refunding them."""
    check_policy(req, ws.policy)
    current, jobs = _cancel_target(in_flight, named, req)
    names = {j.launch for j in jobs}
    for i, name in enumerate(req.launches):
        if name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise RequestError(
                "cancel.unknown_launch",
                f"{name!r} is not a launch of sleep {current.id!r} (its launches: {known})",
                f"$.launches[{i}]",
            )
    wanted = set(req.launches) or names
    targets = tuple(j for j in jobs if j.launch in wanted and j.state in LIVE_TASK_STATES)
    balance = ws.balance
    cancelled: list[JobRow] = []
    for j in targets:
        if j.job_id is None and j.state == "PENDING":
            balance = ledger.refund_unrun(balance, j)
            cancelled.append(j)
    return CancelPlan(sleep=current, targets=targets, now_cancelled=tuple(cancelled), balance=balance)


def cancelled_by(jobs: Sequence[JobRow], names: Sequence[str], received_at: str) -> list[JobRow]:
    """The tasks a cancel received at `received_at` stopped, for its answer: those of the named launches (all
    without names) still live when the executor was called, and those whose move to CANCELLED the kernel
    recorded at or after the cancel (in the cancel's own transaction, or later as the scheduler stopped them).
    A task that had ended or had been cancelled by an earlier cancel is not listed, so a second cancel answers
    with nothing.

    Both sides are the kernel's own records: `received_at` and a job's `updated_at` (stamped by the kernel when
    it records a state change; the wake's budget release leaves it alone), never the backend's `ended_at`, which
    a Slurm node whose clock is behind the kernel's could put before the cancel."""
    wanted = set(names) or {j.launch for j in jobs}
    return [
        j
        for j in jobs
        if j.launch in wanted
        and (j.state in LIVE_TASK_STATES or (j.state == "CANCELLED" and j.updated_at >= received_at))
    ]


# Where a woken sleep's logs are (gather.deliver_log): what `tail` cannot reach is named in its refusal.
OLDER_LOGS: Final = (
    f"{CHANNEL_DIR}/{ChannelPaths.RESULTS}/<seq>/<launch>/{RunPaths.STDOUT} (an array's task: "
    f"{CHANNEL_DIR}/{ChannelPaths.RESULTS}/<seq>/<launch>/<task>/{RunPaths.STDOUT}; {RunPaths.STDERR} beside it), "
    "at most the last log_max_bytes (kernel.json) of each"
)


def tail_target(
    in_flight: Sequence[Sleep], named: Sleep | None, last: Sleep | None, req: TailRequest
) -> tuple[SleepRow, JobRow]:
    """The sleep and task a `tail` names, or RequestError saying why there is none. The sleep: `named` (the
    workspace's sleep of the id `req.sleep`, if it has one), which must be in flight or the last; without an id,
    the newest sleep in flight with the launch, else `last` (the workspace's newest sleep)."""
    if req.sleep is not None:
        if named is None:
            raise RequestError(
                "tail.unknown_sleep",
                f"this workspace has no sleep {req.sleep!r} (in flight: {named_sleeps(in_flight) or 'none'})",
                "$.sleep",
            )
        if named[0].state in SLEEP_OVER_FOR_AGENT and (last is None or named[0].seq != last[0].seq):
            raise RequestError(
                "tail.no_sleep",
                f"sleep {named[0].id!r} (seq {named[0].seq}) has woken and is not the last sleep; tail reaches "
                f"the sleeps in flight and the last one. Its logs were delivered when it woke: {OLDER_LOGS}",
                "$.sleep",
            )
        chosen: Sleep | None = named
    else:
        with_launch = [x for x in in_flight if any(j.launch == req.launch for j in x[1])]
        chosen = with_launch[-1] if with_launch else last
    if chosen is None:
        raise RequestError("tail.no_sleep", "this workspace has no sleep yet; nothing has run to tail", None)
    sleep, jobs = chosen
    tasks = [j for j in jobs if j.launch == req.launch]
    if not tasks:
        known = ", ".join(sorted({j.launch for j in jobs})) or "none"
        reach = (
            ""
            if req.sleep is not None
            else " (no sleep in flight has it); tail reaches the sleeps in flight, else the last one "
            f"(sleep {sleep.seq}). An earlier sleep's logs were delivered when it woke, as its wake names them: "
            f"{OLDER_LOGS}"
        )
        raise RequestError(
            "tail.unknown_task",
            f"{req.launch!r} is not a launch of sleep {sleep.id!r} (its launches: {known}){reach}",
            "$.launch",
        )
    for j in tasks:
        if j.task == req.task:
            return sleep, j
    raise RequestError(
        "tail.unknown_task",
        f"launch {req.launch!r} of sleep {sleep.id!r} has tasks 0..{len(tasks) - 1}, not {req.task}",
        "$.task",
    )


def job_refs(jobs: Sequence[JobRow]) -> tuple[JobRef, ...]:
    return tuple(JobRef(launch=j.launch, task=j.task, job_id=j.job_id) for j in jobs)


# --- read-only answers -----------------------------------------------------------------------------------


def launch_summaries(jobs: Sequence[JobRow], max_concurrent_gpus: int) -> tuple[LaunchSummary, ...]:
    """One summary per launch of `jobs`, in order: its command and how many of its tasks run at once (and why
    fewer than it asked, when the workspace's GPU ceiling lowers it). The wake and `status` both show these."""
    first: dict[str, JobRow] = {}
    for j in jobs:
        first.setdefault(j.launch, j)
    return tuple(
        LaunchSummary(
            name=j.launch,
            command=j.command,
            array=j.array_size,
            at_a_time=width_of(j, max_concurrent_gpus),
            gpus=j.gpus,
            minutes=j.minutes,
            clamp=clamp_note(j.array_size, j.concurrency, j.gpus, max_concurrent_gpus, j.width),
            why=j.why,
            mem_mb=j.mem_mb,
            cpus=j.cpus,
            sweep=sweep.axes_of(t.params for t in jobs if t.launch == j.launch) if j.params else (),
            rank=j.rank,
        )
        for j in first.values()
    )


def sleep_view(s: SleepRow, jobs: Sequence[JobRow], now: float, max_concurrent_gpus: int) -> SleepView:
    return SleepView(
        launches=launch_summaries(jobs, max_concurrent_gpus),
        id=s.id,
        seq=s.seq,
        state=s.state,
        created_at=s.created_at,
        woken_at=s.woken_at,
        note=s.note,
        wake_on=s.wake_on,
        rest=s.rest,
        tasks=tuple(
            TaskView(
                launch=j.launch,
                task=j.task,
                state=j.state,
                job_id=j.job_id,
                exit_code=j.exit_code,
                elapsed_s=elapsed(j, now),
            )
            for j in jobs
        ),
    )


def progress_file(
    s: SleepRow, jobs: Sequence[JobRow], updated_at: str, environment: EnvironmentBuild | None = None
) -> ProgressFile:
    """`results/<seq>/progress.json` of a sleep in flight: each task as recorded; an ended task's elapsed time;
    the environment build it waits for (or waited for), without its log."""
    return ProgressFile(
        protocol=L.PROTOCOL_VERSION,
        id=s.id,
        seq=s.seq,
        state=s.state,
        updated_at=updated_at,
        environment=None if environment is None else msgspec.structs.replace(environment, log_tail=""),
        tasks=tuple(
            TaskProgress(
                launch=j.launch,
                task=j.task,
                state=j.state,
                job_id=j.job_id,
                exit_code=j.exit_code,
                started_at=j.started_at,
                ended_at=j.ended_at,
                elapsed_s=elapsed(j, 0.0) if j.state in TERMINAL_TASK_STATES and j.ended_at else None,
            )
            for j in jobs
        ),
    )


def status_target(
    in_flight: Sequence[Sleep], named: Sleep | None, last: Sleep | None, req: StatusRequest
) -> Sleep | None:
    """The sleep a `status` shows: `named` (the workspace's sleep of the id `req.sleep`; refused when it has
    none), else the newest in flight, else `last` (the workspace's newest sleep; None: it has none)."""
    if req.sleep is not None:
        if named is None:
            raise RequestError(
                "status.unknown_sleep",
                f"this workspace has no sleep {req.sleep!r} (in flight: {named_sleeps(in_flight) or 'none'})",
                "$.sleep",
            )
        return named
    return in_flight[-1] if in_flight else last


def sleep_brief(s: SleepRow, jobs: Sequence[JobRow]) -> SleepBrief:
    return SleepBrief(
        id=s.id,
        seq=s.seq,
        state=s.state,
        created_at=s.created_at,
        tasks=len(jobs),
        ended=sum(1 for j in jobs if j.state in TERMINAL_TASK_STATES),
    )


def status_answer(
    request_id: str,
    kernel: KernelRef,
    ws: WorkspaceRow,
    shown: Sleep | None,
    in_flight: Sequence[Sleep],
    now: float,
    environment: EnvironmentBuild | None = None,
) -> StatusAnswer:
    """`status`: the budget, every sleep in flight in brief (oldest first), and `shown` (status_target's) whole,
    with the environment build its tasks wait for (if any)."""
    view = None if shown is None else sleep_view(shown[0], shown[1], now, ws.policy.max_concurrent_gpus)
    if view is not None and environment is not None:
        view = msgspec.structs.replace(view, environment=environment)
    return StatusAnswer(
        protocol=L.PROTOCOL_VERSION,
        id=request_id,
        kernel=kernel,
        budget=ws.balance.to_message(),
        sleep=view,
        in_flight=tuple(sleep_brief(s, jobs) for s, jobs in in_flight),
    )


def queue_answer(
    request_id: str, ws_key: str, live: Sequence[JobRow], now: float, ids: Mapping[int, str]
) -> QueueAnswer:
    """`queue`: every live task of the kernel; this workspace's (`ws_key`) with its sleep's id (`ids`: by seq)."""
    return QueueAnswer(
        protocol=L.PROTOCOL_VERSION,
        id=request_id,
        jobs=tuple(
            QueueEntry(
                mine=j.workspace == ws_key,
                workspace=j.workspace,
                launch=j.launch,
                task=j.task,
                state=j.state,
                minutes=j.minutes,
                gpus=j.gpus,
                why=j.why,
                elapsed_s=elapsed(j, now),
                sleep=ids.get(j.seq) if j.workspace == ws_key else None,
            )
            for j in live
        ),
    )


def metric_best(jobs: Sequence[JobRow], metric: str) -> MetricBest:
    """A sleep's best value of `metric` (`-key`: the highest) over its tasks' recorded last JSON lines."""
    found, reported = sweep.best([(j.launch, j.task, j.metrics, j.params) for j in jobs], metric)
    if found is None:
        return MetricBest(reported=0, tasks=len(jobs))
    value, launch, task, params = found
    return MetricBest(
        reported=reported,
        tasks=len(jobs),
        value=value,
        launch=launch,
        task=task,
        params=dict(params) if params else None,
    )


def history_answer(
    request_id: str,
    sleeps: Sequence[tuple[SleepRow, Sequence[JobRow]]],
    snapshots: Mapping[int, str] | None = None,
    metric: str | None = None,
) -> HistoryAnswer:
    """`history`: each sleep newest first; with `metric`, its best value of that key of the tasks' JSON lines."""
    entries = []
    for s, jobs in sleeps:
        launches: dict[str, list[JobRow]] = {}
        for j in jobs:
            launches.setdefault(j.launch, []).append(j)
        verdict = _verdict_decoder.decode(s.verdict) if s.verdict else None
        entries.append(
            HistoryEntry(
                id=s.id,
                seq=s.seq,
                state=s.state,
                created_at=s.created_at,
                woken_at=s.woken_at,
                note=s.note,
                launches=tuple(
                    HistoryLaunch(
                        name=name,
                        array=tasks[0].array_size,
                        states=tuple(t.state for t in tasks),
                        why=tasks[0].why,
                    )
                    for name, tasks in launches.items()
                ),
                verdict=verdict.outcome if verdict else None,
                snapshot=(snapshots or {}).get(s.seq),
                base_value=verdict.base_value if verdict else None,
                candidate_value=verdict.candidate_value if verdict else None,
                metric=None if metric is None else metric_best(jobs, metric),
            )
        )
    if metric is None:
        return HistoryAnswer(protocol=L.PROTOCOL_VERSION, id=request_id, sleeps=tuple(entries))
    key, descending = sweep.parse_rank(metric)
    return HistoryAnswer(
        protocol=L.PROTOCOL_VERSION,
        id=request_id,
        sleeps=tuple(entries),
        metric=key,
        best="max" if descending else "min",
    )


# --- retrying the executor -----------------------------------------------------------------------------


def retry_delay(failures: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before the `failures`-th retry of a workspace whose executor call failed for the world's
    reasons (`ExecutorUnavailable`): `base_s`, doubling per failure, never more than `cap_s`."""
    if failures < 1:
        return 0.0
    return min(cap_s, base_s * 2.0 ** min(failures - 1, 62))


# --- fairness --------------------------------------------------------------------------------------------


def plan_pass(
    pending: Mapping[str, int], after: str | None, per_workspace: int, per_pass: int
) -> tuple[list[tuple[str, int]], str | None]:
    """Round-robin over the workspaces with pending work, starting after `after`.

    Each gets at most `per_workspace` requests and the pass at most `per_pass` in all. Returns the plan and the
    key to start after next time, so workspaces cut off by `per_pass` go first in the next pass.
    """
    keys = sorted(k for k, n in pending.items() if n > 0)
    if not keys:
        return [], after
    i = bisect.bisect_right(keys, after) if after is not None else 0
    plan: list[tuple[str, int]] = []
    left, last = per_pass, after
    for key in keys[i:] + keys[:i]:
        if left <= 0:
            break
        n = min(per_workspace, pending[key], left)
        plan.append((key, n))
        left -= n
        last = key
    return plan, last
