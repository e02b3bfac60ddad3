"""Every message of the protocol as a strict msgspec Struct.

Requests (agent -> kernel), answers (kernel -> agent), the wake, and the kernel-written `kernel.json` and
`budget.json`. Requests and answers are tagged unions on the `type` field. All Structs are frozen and refuse
unknown fields; request fields carry their limits (from `channel.limits`) so that the generated JSON Schema and
the decoder agree by construction. Decoding lives in `channel.decode`; this module only declares shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from channel import limits as L

# --- reusable field types -------------------------------------------------------------------------------

RequestId = Annotated[str, Meta(pattern=L.ID_PATTERN, description="client-chosen id, equal to the file stem")]
LaunchName = Annotated[str, Meta(pattern=L.NAME_PATTERN)]
Protocol = Annotated[int, Meta(ge=L.PROTOCOL_VERSION, le=L.PROTOCOL_VERSION)]
Timestamp = Annotated[str, Meta(description="RFC 3339 UTC timestamp, e.g. 2026-11-30T12:00:00.000Z")]

TaskState = Literal[
    "PENDING",
    "RUNNING",
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "CANCELLED",
    "NODE_FAIL",
    "PREEMPTED",
    "VANISHED",
    "REUSED",
    "SKIPPED",
]
SleepState = Literal[
    "received",
    "validated",
    "snapshotted",
    "submitted",
    "running",
    "early_gathered",
    "early_woken",
    "gathered",
    "woken",
    "rejected",
]
# When a sleep wakes (spec 4.4.1): every task ended (`all`), the first task that ended without success, the first
# that ended however, or once N tasks ended; and what an early wake does with the tasks still running.
WakeOn = Literal["all", "first-failure", "first-exit"] | Annotated[int, Meta(ge=1, le=L.WAKE_ON_MAX)]
Rest = Literal["run", "cancel"]
# Which wake a wake file is: the sleep's only one, an early one (some tasks still running), or the rest's.
WakePart = Literal["whole", "early", "rest"]


class _Strict(Struct, frozen=True, forbid_unknown_fields=True):
    pass


# --- requests ------------------------------------------------------------------------------------------


SweepKey = Annotated[str, Meta(pattern=L.SWEEP_KEY_PATTERN)]
SweepValue = Annotated[str, Meta(pattern=L.SWEEP_VALUE_PATTERN)]
MetricKey = Annotated[str, Meta(pattern=L.METRIC_KEY_PATTERN)]


class SweepAxis(_Strict, frozen=True):
    """One key of a launch's sweep and its values, in order (spec 4.4.6)."""

    key: SweepKey
    values: Annotated[tuple[SweepValue, ...], Meta(min_length=1, max_length=L.ARRAY_MAX)]


class Launch(_Strict, frozen=True):
    """One staged job (or job array) of a sleep."""

    name: LaunchName
    command: Annotated[str, Meta(min_length=1, max_length=L.COMMAND_MAX_CHARS)]
    minutes: Annotated[int, Meta(ge=L.MINUTES_MIN, le=L.MINUTES_CEILING)] = L.MINUTES_DEFAULT
    gpus: Annotated[int, Meta(ge=0, le=L.GPUS_CEILING)] = 0
    # Per task: memory (MB) and CPUs the task asks for; absent (null) = the site's default for a task.
    mem_mb: Annotated[int, Meta(ge=L.MEM_MB_MIN, le=L.MEM_MB_CEILING)] | None = None
    cpus: Annotated[int, Meta(ge=1, le=L.CPUS_CEILING)] | None = None
    array: Annotated[int, Meta(ge=1, le=L.ARRAY_MAX)] = 1
    concurrency: Annotated[int, Meta(ge=0, le=L.ARRAY_MAX)] = 0
    artifacts: Annotated[
        tuple[Annotated[str, Meta(min_length=1, max_length=L.ARTIFACT_MAX_CHARS)], ...],
        Meta(max_length=L.MAX_ARTIFACTS),
    ] = ()
    why: Annotated[str, Meta(max_length=L.WHY_MAX_CHARS)] = ""
    # The grid the array runs (its cartesian product, the last key varying fastest; `array` equals its size), and
    # the key of the tasks' last JSON line the wake ranks them by (`-key`: higher is better).
    sweep: Annotated[tuple[SweepAxis, ...], Meta(max_length=L.SWEEP_MAX_KEYS)] = ()
    rank: MetricKey | None = None


class Submit(_Strict, frozen=True):
    """A request for a paired baseline/candidate evaluation of the sleep's snapshot."""

    report: Annotated[str, Meta(min_length=1, max_length=L.REPORT_MAX_CHARS)]
    eval_minutes: Annotated[int, Meta(ge=L.MINUTES_MIN, le=L.MINUTES_CEILING)] | None = None


class _Request(_Strict, tag_field="type", frozen=True):
    protocol: Protocol
    id: RequestId


class SleepRequest(_Request, tag="sleep", frozen=True):
    """Commit staged launches (0 = checkpoint) and an optional submit; park until all jobs end."""

    launches: Annotated[tuple[Launch, ...], Meta(max_length=L.MAX_LAUNCHES)] = ()
    submit: Submit | None = None
    note: Annotated[str, Meta(max_length=L.NOTE_MAX_CHARS)] = ""
    # When the sleep wakes: `all` its tasks ended, `first-failure`, `first-exit`, or N of them ended (at most its
    # task count); `rest`: what an early wake does with the tasks still running ("run": they go on, and the rest
    # wake delivers them; "cancel": they are cancelled, and the one wake comes once they have stopped).
    wake_on: WakeOn = "all"
    rest: Rest = "run"


class CancelRequest(_Request, tag="cancel", frozen=True):
    """Cancel running launches (empty list = all of them) of the sleep `sleep` names, or of the one in flight."""

    launches: Annotated[tuple[LaunchName, ...], Meta(max_length=L.CANCEL_MAX_NAMES)] = ()
    # The sleep's id; null: the one sleep in flight (refused `cancel.which_sleep` when several are).
    sleep: RequestId | None = None


class StatusRequest(_Request, tag="status", frozen=True):
    """What the kernel knows of this workspace: the sleeps in flight, one sleep's tasks, budget."""

    # The sleep to show; null: the newest in flight, else the last.
    sleep: RequestId | None = None


class QueueRequest(_Request, tag="queue", frozen=True):
    """This kernel's jobs across all workspaces."""


class HistoryRequest(_Request, tag="history", frozen=True):
    """This workspace's past sleeps, newest first."""

    limit: Annotated[int, Meta(ge=1, le=L.HISTORY_MAX)] = L.HISTORY_DEFAULT
    # A key of the tasks' last JSON lines: each sleep's best value of it (`-key`: the highest; else the lowest).
    metric: MetricKey | None = None


class TailRequest(_Request, tag="tail", frozen=True):
    """The last lines of one task's stdout (or stderr) so far, of a sleep in flight (else the last one)."""

    launch: LaunchName
    task: Annotated[int, Meta(ge=0, le=L.ARRAY_MAX - 1)] = 0
    lines: Annotated[int, Meta(ge=1, le=L.TAIL_VERB_MAX_LINES)] = L.TAIL_VERB_DEFAULT_LINES
    stderr: bool = False
    # The sleep's id; null: the newest sleep in flight with that launch, else the last sleep.
    sleep: RequestId | None = None


Request = SleepRequest | CancelRequest | StatusRequest | QueueRequest | HistoryRequest | TailRequest
REQUEST_TYPES: Final = (SleepRequest, CancelRequest, StatusRequest, QueueRequest, HistoryRequest, TailRequest)
Verb = Literal["sleep", "cancel", "status", "queue", "history", "tail"]
VERBS: Final[tuple[Verb, ...]] = ("sleep", "cancel", "status", "queue", "history", "tail")

# --- shared pieces of answers ----------------------------------------------------------------------------


class Budget(_Strict, frozen=True):
    """What the workspace may still spend. `reserved_gpu_hours` is held by running work and refunded as measured."""

    launches: int
    sleeps: int
    gpu_hours: float
    reserved_gpu_hours: float = 0.0


class ErrorInfo(_Strict, frozen=True):
    code: str
    message: str
    path: str | None = None


class JobRef(_Strict, frozen=True):
    launch: str
    task: int
    job_id: str | None = None


class TaskView(_Strict, frozen=True):
    launch: str
    task: int
    state: TaskState
    job_id: str | None = None
    exit_code: int | None = None
    elapsed_s: float | None = None


class LaunchSummary(_Strict, frozen=True):
    """A launch of the sleep as it ran: its command and how many of its tasks ran at once (and why fewer)."""

    name: str
    command: str
    array: int = 1
    # How many of its tasks run at once, decided when the sleep was accepted (kernel.core.rules.accept_sleep);
    # `clamp` says why, when that is fewer than it asked for.
    at_a_time: int = 1
    gpus: int = 0
    minutes: int = L.MINUTES_DEFAULT
    clamp: str | None = None
    # What the launch asked for per task (null: the site's default).
    mem_mb: int | None = None
    cpus: int | None = None
    why: str = ""
    # The launch's sweep and the key it is ranked by, as staged; in a wake, its tasks in that order (`ranking`).
    sweep: tuple[SweepAxis, ...] = ()
    rank: str | None = None
    ranking: tuple[RankedTask, ...] = ()


class RankedTask(_Strict, frozen=True):
    """A task of a ranked launch, best first: the value of the rank key in its last JSON line, or (`value` null,
    listed after every ranked task) why it has none."""

    task: int
    value: float | None = None
    unranked: str | None = None


class EnvironmentBuild(_Strict, frozen=True):
    """The locked environment a sleep waits for (spec 7.1): the kernel builds it from the snapshot's `lock` in the
    background and dispatches the sleep's tasks once it is `ready`; `started_at` is null while the build waits
    for a build slot. In a status, `log_tail` holds the last lines uv printed so far."""

    lock_sha256: str
    state: Literal["building", "ready", "failed"]
    lock: str = "uv.lock"
    started_at: Timestamp | None = None
    log_tail: str = ""


class SleepView(_Strict, frozen=True):
    id: str
    seq: int
    state: SleepState
    created_at: Timestamp
    note: str = ""
    tasks: tuple[TaskView, ...] = ()
    woken_at: Timestamp | None = None
    # Each launch as it runs (or ran): how many of its tasks at once, and why fewer than asked (`clamp`).
    launches: tuple[LaunchSummary, ...] = ()
    # The environment build the sleep's tasks wait for, while there is one (null otherwise).
    environment: EnvironmentBuild | None = None
    # The sleep's wake condition and what an early wake does with the rest (spec 4.4.1).
    wake_on: WakeOn = "all"
    rest: Rest = "run"


class SleepBrief(_Strict, frozen=True):
    """A sleep in flight, in one line: how many of its tasks have ended."""

    id: str
    seq: int
    state: SleepState
    created_at: Timestamp
    tasks: int
    ended: int


class KernelRef(_Strict, frozen=True, omit_defaults=True):
    name: str
    version: str
    # The commit the kernel was built from (absent where its build had no git metadata).
    commit: str | None = None


class QueueEntry(_Strict, frozen=True):
    mine: bool
    workspace: str
    launch: str
    task: int
    state: TaskState
    minutes: int
    gpus: int
    why: str = ""
    elapsed_s: float | None = None
    # The id of the task's sleep (this workspace's tasks only; null for another workspace's).
    sleep: str | None = None


class HistoryLaunch(_Strict, frozen=True):
    name: str
    array: int
    states: tuple[TaskState, ...]
    why: str = ""


class MetricBest(_Strict, frozen=True):
    """`history --metric`: a sleep's best value of the metric, the task that reported it and that task's sweep
    values; `reported` of `tasks` tasks gave it as a finite number (`value` null when none did)."""

    reported: int
    tasks: int
    value: float | None = None
    launch: str | None = None
    task: int | None = None
    params: dict[str, str] | None = None


class HistoryEntry(_Strict, frozen=True):
    id: str
    seq: int
    state: SleepState
    created_at: Timestamp
    woken_at: Timestamp | None = None
    note: str = ""
    launches: tuple[HistoryLaunch, ...] = ()
    verdict: str | None = None
    snapshot: str | None = None
    base_value: float | None = None
    candidate_value: float | None = None
    # With the request's `metric`: this sleep's best value of it.
    metric: MetricBest | None = None


class ContractChange(_Strict, frozen=True):
    """One value of the workspace's contract that changed: its dotted key in `kernel.json` (`policy.max_minutes`),
    its value before and now; `old` or `new` is absent where the contract had no such key then or has none now."""

    key: str
    old: Any | UnsetType = UNSET
    new: Any | UnsetType = UNSET


class ContractChanged(_Strict, frozen=True):
    """What of the workspace's contract (`kernel.json`'s `limits`, `policy`, `verbs`, `submit_trusted`,
    `submit_verdicts`) changed since the kernel's last answer or wake to it, told once (spec 7.4): `text`, the
    sentence the markdown wake shows, and every change."""

    text: str
    changes: tuple[ContractChange, ...]


# --- answers ---------------------------------------------------------------------------------------------


class _Answer(_Strict, tag_field="type", frozen=True):
    protocol: int
    id: str


class Accepted(_Answer, tag="accepted", frozen=True, omit_defaults=True):
    """A sleep was validated, charged and its jobs submitted, or (`building` set) accepted before its locked
    environment was built: its jobs are submitted once it is (their `job_id` null until then), and a build that
    fails wakes the sleep with `environment.failed`, refunded. `building` is left out when the jobs were
    submitted (the only member with a default)."""

    sleep_seq: int
    jobs: tuple[JobRef, ...]
    budget: Budget
    building: EnvironmentBuild | None = None
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET


class Rejected(_Answer, tag="rejected", frozen=True):
    """The request was refused; nothing was done and nothing was charged."""

    error: ErrorInfo
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET


class StatusAnswer(_Answer, tag="status", frozen=True):
    kernel: KernelRef
    budget: Budget
    sleep: SleepView | None = None
    # Every sleep in flight (accepted, not yet woken), oldest first.
    in_flight: tuple[SleepBrief, ...] = ()
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET


class QueueAnswer(_Answer, tag="queue", frozen=True):
    jobs: tuple[QueueEntry, ...]
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET


class HistoryAnswer(_Answer, tag="history", frozen=True):
    sleeps: tuple[HistoryEntry, ...]
    # The request's `metric` (its key) and which end of it is best ("min", "max"); null without one.
    metric: str | None = None
    best: Literal["min", "max"] | None = None
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET


class Cancelled(_Answer, tag="cancelled", frozen=True):
    sleep: str
    cancelled: tuple[JobRef, ...]
    budget: Budget
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET


class TailAnswer(_Answer, tag="tail", frozen=True):
    """A task's output so far: its last whole lines (at most the lines asked and `TAIL_VERB_MAX_BYTES`)."""

    sleep: str
    launch: str
    task: int
    state: TaskState
    # "environment": the task waits for its sleep's environment build, and `text` is the build's log so far.
    stream: Literal["stdout", "stderr", "environment"]
    text: str
    lines: int
    size: int
    cut: bool
    job_id: str | None = None
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET


Answer = Accepted | Rejected | StatusAnswer | QueueAnswer | HistoryAnswer | Cancelled | TailAnswer
ANSWER_TYPES: Final = (Accepted, Rejected, StatusAnswer, QueueAnswer, HistoryAnswer, Cancelled, TailAnswer)

# --- the wake --------------------------------------------------------------------------------------------


class Artifact(_Strict, frozen=True):
    """An artifact delivered into the channel, with evidence of what was delivered. `partial`: its task was
    stopped before its command ended (channel.lifecycle.STOPPED_TASK_STATES), so the file is as the job had
    written it by then."""

    path: str
    delivered: str
    size: int
    sha256: str
    partial: bool = False


class SkippedArtifact(_Strict, frozen=True):
    path: str
    reason: str


class LogFile(_Strict, frozen=True):
    """A task's stdout or stderr as a whole: how much the job wrote, how much of it the tail shows, and where the
    full log was delivered (the last `log_max_bytes` of it, from `delivered_from`, when it is longer)."""

    size: int
    lines: int
    tail_bytes: int
    tail_lines: int
    delivered: str | None = None
    delivered_from: int = 0
    sha256: str | None = None
    reason: str | None = None


class TaskResult(_Strict, frozen=True):
    launch: str
    task: int
    state: TaskState
    job_id: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    elapsed_s: float | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    artifacts: tuple[Artifact, ...] = ()
    skipped: tuple[SkippedArtifact, ...] = ()
    why: str = ""
    hint: str | None = None
    stdout_log: LogFile | None = None
    stderr_log: LogFile | None = None
    # The last line of stdout that is a JSON object (a job's result, by convention), as the job printed it.
    result: str | None = None
    # A swept launch's task: its value of each sweep key (null: the launch has no sweep).
    params: dict[str, str] | None = None


Outcome = Literal["improved", "not_improved", "failed", "unchanged"]
PairTest = Literal["sign", "bootstrap"]
# What a verdict discloses about the private data across a workspace's submits (spec 4.5.7).
Disclosure = Literal["exact", "ladder", "thresholdout"]
# Whether a stored base measurement stands in for a later submit's base runs (then on its own seeds).
ReuseBase = Literal["same-seeds", "never"]


class Pair(_Strict, frozen=True):
    """One seed's base and candidate values (the seed itself stays private)."""

    base: float
    candidate: float
    delta: float  # candidate - base


class SidePath(_Strict, frozen=True):
    """A path of one side's tree that the evaluation left out, and why (kernel-written; the path is the
    candidate's, shown quoted)."""

    side: Literal["base", "candidate"]
    path: str
    why: str


class Verdict(_Strict, frozen=True):
    """A submit's verdict. With repeats, the values are means over the pairs and `delta` is the mean difference.

    `trusted`: the metric came from the operator's `score` stage (or from `command` with the whole tree
    protected) in a real jail; false means the candidate's own code printed it (self-reported)."""

    outcome: Outcome
    metric: str
    direction: Literal["higher", "lower"]
    base_value: float | None = None
    candidate_value: float | None = None
    delta: float | None = None
    min_delta: float | None = None
    min_relative: float | None = None
    failed_side: Literal["base", "candidate"] | None = None
    reason: str | None = None
    baseline_reused: bool = False
    base_commit: str | None = None
    candidate_commit: str | None = None
    trusted: bool = False
    # sha256 hex of the base tree and the private seeds (kernel.core.evaluate.seed_commitment); null without seeds
    seed_commitment: str | None = None
    repeats: int = 1
    pairs: tuple[Pair, ...] = ()
    test: PairTest | None = None  # the one-sided test on the pairs (N >= 3), else null
    confidence: float | None = None
    p_value: float | None = None  # the sign test's
    lower_bound: float | None = None  # the bootstrap's lower bound of the mean improvement
    protected_changed: tuple[str, ...] = ()  # protected paths the candidate changed (replaced by the base's)
    # With protected paths: the side's files that could run in place of a protected file (bytecode caches,
    # interpreter hooks, same-named packages or extension modules), removed before the run; the first ones and
    # how many in all.
    shadows_removed: tuple[SidePath, ...] = ()
    shadows_removed_count: int = 0
    # With a score stage: the paths of a side's tree (after its command) that are not in the copy the scorer
    # read (anything but regular files and directories); the distinct first ones over the runs, and the most
    # that one run's copy left out.
    scorer_unseen: tuple[SidePath, ...] = ()
    scorer_unseen_count: int = 0
    # The base measurement (and so the private seeds both sides ran with) of this earlier submit (its seq) stood
    # in for the base runs (`baseline_reused`); null when this submit drew its own seeds.
    seeds_from_seq: int | None = None
    # What the verdict discloses (spec 4.5.7). Under "ladder" and "thresholdout" the base and candidate values,
    # the pairs, the p-value and the bound are withheld and `delta` is the disclosed difference.
    disclosure: Disclosure = "exact"
    ladder_step: float | None = None  # ladder: values are multiples of it
    best_so_far: float | None = (
        None  # ladder: the best disclosed improvement after this verdict (0: the base)
    )
    private_disclosed: bool | None = (
        None  # thresholdout: delta is the private value plus noise (else the public)
    )
    budget_left: int | None = None  # thresholdout: how many more private disclosures the workspace has


class Wake(_Strict, frozen=True):
    """`wakes/<sleep-id>.json`: everything the agent needs when its sleep ends."""

    protocol: int
    id: str
    seq: int
    created_at: Timestamp
    woken_at: Timestamp
    budget: Budget
    note: str = ""
    tasks: tuple[TaskResult, ...] = ()
    verdict: Verdict | None = None
    refunded_gpu_hours: float = 0.0
    # The commit the kernel snapshotted and every job of the sleep ran on.
    snapshot: str | None = None
    launches: tuple[LaunchSummary, ...] = ()
    # Why none of the sleep's tasks ran, for a sleep accepted and then unable to run (its environment build
    # failed: `environment.failed`); its whole charge is refunded. Null for every sleep whose tasks were submitted.
    error: ErrorInfo | None = None
    # What of the contract changed since the kernel's last answer or wake to this workspace (spec 7.4); absent
    # when nothing did.
    contract_changed: ContractChanged | UnsetType = UNSET
    # The sleep's wake condition and what it does with the rest, as requested (spec 4.4.1, 8.8).
    wake_on: WakeOn = "all"
    rest: Rest = "run"
    # "whole": the sleep's one wake; "early": woken by `wake_on` while `rest_tasks` still ran (their entries here
    # show their state then; `wakes/<id>.rest.json` delivers them); "rest": that delivery, every task final.
    part: WakePart = "whole"
    # The task whose end met `wake_on` (null: the sleep woke because every task ended).
    trigger: JobRef | None = None
    # The tasks still live when `wake_on` was met: left running (`rest` "run"; delivered by the rest wake) or
    # cancelled (`rest` "cancel"; CANCELLED in this wake).
    rest_tasks: tuple[JobRef, ...] = ()


# --- kernel-written channel files ------------------------------------------------------------------------


# An eval contract's metric is a JSON key the eval prints: identifier-like, so it is unambiguous in a line of
# output and in a verdict. Floors are finite and non-negative (the bound only rules out infinity).
METRIC_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,63}$"
FLOOR_MAX: Final = 1e15
_Floor = Annotated[float, Meta(ge=0, le=FLOOR_MAX)]


# A protected path pattern: relative, '/'-separated; `*` and `?` within one component, `**` any number of them.
PROTECTED_PATTERN: Final = r"^(?!/)(?!.*(^|/)\.\.?(/|$))(?!.*//)[^\x00-\x1f\\]+$"
ABS_PATH_PATTERN: Final = r"^/[^\x00-\x1f]*$"


class EvalContract(_Strict, frozen=True):
    """The operator's evaluation contract for `submit`; agents read it, never set it.

    `command` runs the agent's code on each side; `score`, when set, is the operator's scorer, run after
    `command` in a separate jail that sees the side's tree read-only, `score_data` read-only and the seeds, and
    only its stdout carries the metric. `score_from`: "operator" (the scorer lives outside every workspace:
    `score_data` or a system directory) or "base" (the base commit's tree, never the candidate's)."""

    command: Annotated[str, Meta(min_length=1, max_length=L.COMMAND_MAX_CHARS)]
    metric: Annotated[str, Meta(pattern=METRIC_PATTERN)]
    direction: Literal["higher", "lower"] = "higher"
    min_delta: _Floor | None = None
    min_relative: _Floor | None = None
    eval_minutes: Annotated[int, Meta(ge=L.MINUTES_MIN, le=L.MINUTES_CEILING)] = L.MINUTES_DEFAULT
    gpus: Annotated[int, Meta(ge=0, le=L.GPUS_CEILING)] = 0
    seed: bool = True
    score: Annotated[str, Meta(min_length=1, max_length=L.COMMAND_MAX_CHARS)] | None = None
    score_data: Annotated[str, Meta(pattern=ABS_PATH_PATTERN, max_length=L.PATH_MAX_CHARS)] | None = None
    score_from: Literal["operator", "base"] = "operator"
    protected: Annotated[
        tuple[Annotated[str, Meta(pattern=PROTECTED_PATTERN, max_length=L.PROTECTED_MAX_CHARS)], ...],
        Meta(max_length=L.PROTECTED_MAX),
    ] = ()
    repeats: Annotated[int, Meta(ge=1, le=L.REPEATS_MAX)] = 1
    confidence: Annotated[float, Meta(ge=0.5, le=0.999)] = 0.95
    test: PairTest = "sign"


class VerdictRules(_Strict, frozen=True):
    """How the kernel makes verdicts across a workspace's submits (the operator's `[verdicts]`; kernel.json
    `submit_verdicts`).

    `reuse_base`: "never" (every submit draws fresh private seeds and measures its base with them) or
    "same-seeds" (a stored base measurement stands in for the base runs, and the candidate then runs on that
    measurement's seeds). `disclosure`: "exact", "ladder" (`ladder_step`) or "thresholdout"
    (`thresholdout_threshold`, `thresholdout_noise`, `thresholdout_budget`); spec 4.5.7."""

    reuse_base: ReuseBase = "never"
    disclosure: Disclosure = "exact"
    ladder_step: Annotated[float, Meta(gt=0, le=1e12)] = 0.01
    thresholdout_threshold: Annotated[float, Meta(ge=0, le=1e12)] = 0.02
    thresholdout_noise: Annotated[float, Meta(gt=0, le=1e12)] = 0.005
    thresholdout_budget: Annotated[int, Meta(ge=0, le=1_000_000)] = 20


class Policy(_Strict, frozen=True):
    """A workspace's ceilings, set by the operator."""

    max_minutes: int = L.POLICY_MAX_MINUTES
    max_gpus: int = L.POLICY_MAX_GPUS
    max_concurrent_gpus: int = L.POLICY_MAX_GPUS
    # The most memory (MB) and CPUs a launch may ask for per task (`mem_mb`, `cpus`).
    max_mem_mb: int = L.POLICY_MAX_MEM_MB
    max_cpus: int = L.POLICY_MAX_CPUS
    network: bool = False
    submit: EvalContract | None = None
    # the verbs this workspace may use (an operator may withhold `queue`, which shows other workspaces' jobs)
    verbs: tuple[Verb, ...] = VERBS
    # The most sleeps carrying a submit this workspace may have accepted in any 24 hours (0: no bound).
    max_submits_per_day: int = 0
    # The most sleeps this workspace may have in flight at once (a next one is refused `sleep.in_progress`).
    max_sleeps_in_flight: int = L.POLICY_MAX_SLEEPS_IN_FLIGHT


class Limits(_Strict, frozen=True):
    """The protocol's limits as published to clients in `kernel.json`."""

    request_max_bytes: int = L.REQUEST_MAX_BYTES
    json_max_depth: int = L.JSON_MAX_DEPTH
    id_pattern: str = L.ID_PATTERN
    name_pattern: str = L.NAME_PATTERN
    max_launches: int = L.MAX_LAUNCHES
    command_max_chars: int = L.COMMAND_MAX_CHARS
    minutes_default: int = L.MINUTES_DEFAULT
    minutes_min: int = L.MINUTES_MIN
    minutes_ceiling: int = L.MINUTES_CEILING
    gpus_ceiling: int = L.GPUS_CEILING
    mem_mb_min: int = L.MEM_MB_MIN
    mem_mb_ceiling: int = L.MEM_MB_CEILING
    cpus_ceiling: int = L.CPUS_CEILING
    array_max: int = L.ARRAY_MAX
    max_artifacts: int = L.MAX_ARTIFACTS
    artifact_max_chars: int = L.ARTIFACT_MAX_CHARS
    why_max_chars: int = L.WHY_MAX_CHARS
    note_max_chars: int = L.NOTE_MAX_CHARS
    report_max_chars: int = L.REPORT_MAX_CHARS
    cancel_max_names: int = L.CANCEL_MAX_NAMES
    history_max: int = L.HISTORY_MAX
    history_default: int = L.HISTORY_DEFAULT
    # The largest N of a sleep's `wake_on` (a sleep's own bound is its task count); its presence announces
    # `wake_on` and `rest` (spec 1.5).
    wake_on_max: int = L.WAKE_ON_MAX
    sweep_max_keys: int = L.SWEEP_MAX_KEYS
    sweep_key_pattern: str = L.SWEEP_KEY_PATTERN
    sweep_reserved_keys: tuple[str, ...] = L.SWEEP_RESERVED_KEYS
    sweep_value_pattern: str = L.SWEEP_VALUE_PATTERN
    metric_key_pattern: str = L.METRIC_KEY_PATTERN
    tail_verb_default_lines: int = L.TAIL_VERB_DEFAULT_LINES
    tail_verb_max_lines: int = L.TAIL_VERB_MAX_LINES
    tail_verb_max_bytes: int = L.TAIL_VERB_MAX_BYTES
    # Kernel-written: the most of each stdout/stderr delivered into results/ (the operator's `log_max_bytes`).
    log_max_bytes: int = L.LOG_MAX_BYTES
    # Kernel-side: the operator's `[snapshot]` limits; a workspace past one is refused `snapshot.too_large` (no
    # charge) before any file is read: unignored files, their bytes in all, directory depth.
    snapshot_max_files: int = L.SNAPSHOT_MAX_FILES
    snapshot_max_bytes: int = L.SNAPSHOT_MAX_BYTES
    snapshot_max_depth: int = L.SNAPSHOT_MAX_DEPTH


class StoreRef(_Strict, frozen=True):
    """The kernel state store that owns a channel: only the kernel serving that store answers it."""

    store: Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
    state_dir: str


class KernelInfo(_Strict, frozen=True):
    """`kernel.json`: who is answering this channel and under which limits."""

    protocol: int
    kernel: KernelRef
    workspace: str
    limits: Limits
    policy: Policy
    verbs: tuple[str, ...]
    tool_sha256: str
    owner: StoreRef | None = None
    # Whether `submit`'s verdicts will be trusted (the metric comes from the operator's score stage, or from
    # files all taken from the base, in a real jail); null without a contract. The kernel decides it.
    submit_trusted: bool | None = None
    # The package index a workspace's uv.lock must be made against (`uv lock --default-index <it>`) when the
    # kernel builds locked environments; null when it builds none.
    package_index: str | None = None
    # How verdicts reuse base measurements and what they disclose; null without a contract.
    submit_verdicts: VerdictRules | None = None


class BudgetFile(_Strict, frozen=True):
    """`budget.json`: the workspace's budget as of `updated_at`."""

    protocol: int
    budget: Budget
    updated_at: Timestamp


# The variables every task of a launch gets (`syscall env` lists them; the job wrapper sets them).
JOB_VARIABLES: Final[tuple[tuple[str, str], ...]] = (
    ("SWEEP_INDEX", "the task's index in its launch's array: 0..array-1 (0 for a single task)"),
    ("SLURM_ARRAY_TASK_ID", "the same index, under Slurm's name"),
    ("SYSCALL_TASK", "the same index again"),
    ("SWEEP_<KEY>", "swept launches only: the task's value of each sweep key (`--sweep lr=...`: SWEEP_LR)"),
    (
        "SWEEP_PARAMS",
        'swept launches only: all of the task\'s values as one JSON object of strings, {"lr": "1e-3"}',
    ),
    ("SYSCALL_LAUNCH", "the launch's name"),
    ("SYSCALL_SLEEP", "the sleep's id (as in the wake)"),
    ("SYSCALL_SNAPSHOT", "the snapshot commit the job's tree was written from"),
    (
        "EVAL_SEED",
        "submit evaluation runs only, when the contract gives the command its seed: the run's seed",
    ),
    ("CUDA_VISIBLE_DEVICES", "tasks with GPUs only: the GPUs the scheduler gave the task"),
)


class Package(_Strict, frozen=True):
    name: str
    version: str


class LockedEnvironment(_Strict, frozen=True):
    """The environment built from the workspace's uv.lock at its latest sleep that had one."""

    lock_sha256: str
    python_version: str
    packages: tuple[Package, ...]
    built_at: Timestamp


class JobVariable(_Strict, frozen=True):
    name: str
    meaning: str


class JobLimits(_Strict, frozen=True):
    """Per task; None = no limit of that kind. `enforced_by` says what enforces them on this kernel."""

    mem_mb: int | None = None
    max_procs: int | None = None
    tmp_mb: int | None = None
    enforced_by: Literal["cgroup", "rlimit", "scheduler", "none"] = "none"


class SnapshotRules(_Strict, frozen=True):
    """What a job's tree holds: the workspace's files at `sleep` time."""

    tracked: bool = True
    untracked: bool = True  # untracked files that no ignore rule matches
    ignored: bool = False
    git_dir: bool = False  # `.git` is never in the tree
    channel: bool = False  # `.syscall/` is never in the tree
    max_file_bytes: int = 0
    max_total_bytes: int = 0
    # the operator's `[snapshot]` limits besides `max_total_bytes` (0: not published)
    max_files: int = 0
    max_depth: int = 0


class JobEnvFile(_Strict, frozen=True):
    """`jobenv.json`: what a job of this workspace sees (written by the kernel; `syscall env` shows it)."""

    protocol: int
    backend: str
    jail: str
    network: bool
    environment: Literal["uv", "none"]  # how a snapshot with a uv.lock is run
    python: str  # the interpreter environments are built on (the jail's python3 without one)
    locked: LockedEnvironment | None
    max_gpus_per_task: int
    limits: JobLimits
    path_dirs: tuple[str, ...]
    variables: tuple[JobVariable, ...]
    snapshot: SnapshotRules
    updated_at: Timestamp
    # As kernel.json's: the index a uv.lock must name; null when the kernel builds no environment.
    package_index: str | None = None


class TaskProgress(_Strict, frozen=True):
    """One task in `progress.json`: its state as the kernel recorded it, its times, and once it has ended its
    exit code and measured run time (`elapsed_s`, null while it runs: the file is not rewritten as time passes)."""

    launch: str
    task: int
    state: TaskState
    job_id: str | None = None
    exit_code: int | None = None
    started_at: Timestamp | None = None
    ended_at: Timestamp | None = None
    elapsed_s: float | None = None


class ProgressFile(_Strict, frozen=True):
    """`results/<seq>/progress.json`: each task of a sleep in flight as the kernel last recorded it, rewritten
    whenever one changes state, so a client can follow the sleep by looking at one file (spec 8.7)."""

    protocol: int
    id: str
    seq: int
    state: SleepState
    updated_at: Timestamp
    tasks: tuple[TaskProgress, ...] = ()
    # The locked environment the sleep's tasks wait for (spec 8.7): `building` (`started_at` null while it waits
    # for a build slot), `ready` once built (its tasks then get job ids), `failed` (the sleep wakes with
    # `environment.failed`); `log_tail` is empty here (`tail` shows the build's output). Null for a sleep that
    # waited for no build in this kernel's run.
    environment: EnvironmentBuild | None = None


_encoder: Final = msgspec.json.Encoder()


def encode(msg: Struct) -> bytes:
    """The canonical encoding of any protocol message (compact JSON, newline-terminated)."""
    return _encoder.encode(msg) + b"\n"
