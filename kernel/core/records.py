"""The kernel's records: one row of each store table as the rest of the kernel sees it (pure data, no I/O).

The store (`kernel.io.store`) is the only code that reads or writes them in sqlite; the pure core (`rules`,
`evaluate`) decides from them, so they live below both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from channel.messages import Policy, Rest, SleepState, TaskState, WakeOn
from channel.safefs import Identity
from kernel.core.budget import Balance


@dataclass(frozen=True, slots=True)
class WorkspaceRow:
    key: str
    path: str
    identity: Identity
    balance: Balance
    policy: Policy
    tool_sha256: str
    watch: str
    enrolled_at: str
    problem: str | None


@dataclass(frozen=True, slots=True)
class RequestRow:
    workspace: str
    id: str
    sha256: str
    type: str
    received_at: str
    sleep_seq: int | None
    # The request itself, kept for requests that must be resumed after a crash (sleep, cancel).
    body: bytes | None
    answer: bytes | None
    answered_at: str | None


@dataclass(frozen=True, slots=True)
class SleepRow:
    workspace: str
    seq: int
    id: str
    state: SleepState
    note: str
    submit: bytes | None
    created_at: str
    woken_at: str | None
    verdict: bytes | None
    # When the sleep wakes and what an early wake does with the rest (the request's `wake_on`, `rest`); the task
    # whose end met `wake_on` ((launch, task); None until the kernel acted on it) and the tasks still live then,
    # which `rest` applies to.
    wake_on: WakeOn = "all"
    rest: Rest = "run"
    trigger: tuple[str, int] | None = None
    rest_tasks: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class JobRow:
    workspace: str
    seq: int
    launch: str
    task: int
    array_size: int
    concurrency: int
    command: str
    minutes: int
    gpus: int
    artifacts: tuple[str, ...]
    why: str
    reserved_gpu_s: int
    state: TaskState
    backend: str | None = None
    job_id: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    started_at: str | None = None
    ended_at: str | None = None
    run_dir: str | None = None
    # When the kernel recorded this task's last change of state or placement, by its own clock (ended_at is the
    # backend's); rules.cancelled_by compares it with a cancel's received_at.
    updated_at: str = ""
    # The memory (MB) and CPUs the task's launch asked for (None: the backend's default for a task).
    mem_mb: int | None = None
    cpus: int | None = None
    # A swept launch's task: its value of each sweep key, in the sweep's order (empty: no sweep); the key its
    # launch is ranked by (`-key`: higher is better); and the numbers of its last JSON line of stdout
    # (channel.sweep.numbers_of), recorded at gathering for `history`'s `metric`.
    params: tuple[tuple[str, str], ...] = ()
    rank: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    # How many tasks of this task's launch run at once, decided when its sleep was accepted
    # (rules.accept_sleep: `concurrency` within the GPUs max_concurrent_gpus left it) and the same on every row
    # of the launch; dispatch, the wake and `status` all use it. None: recorded by a kernel that decided it at
    # dispatch (channel.decode.at_a_time under the policy of the time).
    width: int | None = None


@dataclass(frozen=True, slots=True)
class ExecSleepRow:
    """What execution recorded for one sleep: its snapshot (ref, commit, kernel tree), the wake it gathered (the
    exact bytes, kept until they are on disk) and whether the snapshot was released after the wake."""

    workspace: str
    seq: int
    ref: str
    commit: str
    tree: str
    wake_json: bytes | None
    wake_md: bytes | None
    released: bool
