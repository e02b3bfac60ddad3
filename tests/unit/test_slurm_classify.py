"""Table tests for classification, pending reasons, task resolution and the poll interval."""

from __future__ import annotations

import pytest

from kernel.backends.slurm import (
    Classification,
    Resolution,
    classify_exit_file,
    classify_state,
    parse_sacct,
    parse_squeue,
    pending_verdict,
    poll_interval,
    read_sacct,
    read_squeue,
    resolve_task,
)
from kernel.backends.slurm.classify import ENDED_STATES, RUNNING_STATES, VANISHED_HINT, WAITING_STATES

ME = 1000


@pytest.mark.parametrize(
    ("state", "status", "signal", "expected_state", "terminal"),
    [
        ("PENDING", None, None, "PENDING", False),
        ("CONFIGURING", None, None, "PENDING", False),
        ("REQUEUED", None, None, "PENDING", False),
        ("RUNNING", None, None, "RUNNING", False),
        ("COMPLETING", None, None, "RUNNING", False),
        ("SUSPENDED", None, None, "RUNNING", False),
        ("COMPLETED", 0, 0, "COMPLETED", True),
        ("COMPLETED", 3, 0, "FAILED", True),
        ("COMPLETED", 0, 9, "FAILED", True),
        ("FAILED", 1, 0, "FAILED", True),
        ("FAILED", 0, 125, "OUT_OF_MEMORY", True),
        ("CANCELLED", 0, 125, "OUT_OF_MEMORY", True),
        ("OUT_OF_MEMORY", 0, 125, "OUT_OF_MEMORY", True),
        ("OUT_OF_MEMORY", None, None, "OUT_OF_MEMORY", True),
        ("TIMEOUT", 0, 0, "TIMEOUT", True),
        ("DEADLINE", 0, 0, "TIMEOUT", True),
        ("NODE_FAIL", 0, 0, "NODE_FAIL", True),
        ("BOOT_FAIL", 0, 0, "NODE_FAIL", True),
        ("PREEMPTED", 0, 0, "PREEMPTED", True),
        ("REVOKED", 0, 0, "VANISHED", True),
        ("CANCELLED", 0, 15, "CANCELLED", True),
        ("CANCELLED by 0", 0, 0, "CANCELLED", True),
        ("CANCELLED+", None, None, "CANCELLED", True),
    ],
)
def test_classify_state(
    state: str, status: int | None, signal: int | None, expected_state: str, terminal: bool
) -> None:
    c = classify_state(state, status, signal)
    assert (c.state, c.terminal) == (expected_state, terminal)


@pytest.mark.parametrize("state", ["UNKNOWN", "", "SOMETHING_NEW", "completed-ish"])
def test_unknown_or_missing_state_is_never_success(state: str) -> None:
    c = classify_state(state, 0, 0)
    assert c.state != "COMPLETED"
    assert not c.recognized
    assert c.hint
    assert "not success" in c.hint


def test_every_known_state_is_recognized() -> None:
    for state in WAITING_STATES | RUNNING_STATES | ENDED_STATES:
        assert classify_state(state, 0, 0).recognized, state


def test_preemption_with_requeue_is_a_wait() -> None:
    assert classify_state("PREEMPTED", requeues=True) == Classification(
        "PENDING", terminal=False, hint="preempted; Slurm requeues it"
    )
    assert classify_state("PREEMPTED", requeues=False).terminal


@pytest.mark.parametrize(
    ("by", "by_kernel", "hint_part"),
    [
        (None, True, None),
        (ME, True, None),
        (ME, False, "scancel outside the kernel (uid 1000)"),
        (0, False, "scheduler or an administrator (uid 0)"),
        (None, False, "cancelled by the scheduler"),
    ],
)
def test_cancel_hints_say_who(by: int | None, by_kernel: bool, hint_part: str | None) -> None:
    c = classify_state("CANCELLED", 0, 15, cancelled_by=by, our_uid=ME, cancelled_by_kernel=by_kernel)
    assert c.state == "CANCELLED"
    if hint_part is None:
        assert c.hint is None
    else:
        assert c.hint is not None
        assert hint_part in c.hint


@pytest.mark.parametrize(
    ("code", "scheduler", "expected", "hint"),
    [
        (0, None, "COMPLETED", None),
        (0, Classification("TIMEOUT", terminal=True), "COMPLETED", None),
        (1, None, "FAILED", None),
        (137, None, "FAILED", "killed by signal 9"),
        (143, Classification("RUNNING", terminal=False), "FAILED", "killed by signal 15"),
        (143, Classification("TIMEOUT", terminal=True), "TIMEOUT", None),
        (1, Classification("OUT_OF_MEMORY", terminal=True), "OUT_OF_MEMORY", None),
        (2, Classification("CANCELLED", terminal=True), "FAILED", None),
    ],
)
def test_exit_file_is_the_ground_truth(
    code: int, scheduler: Classification | None, expected: str, hint: str | None
) -> None:
    c = classify_exit_file(code, scheduler)
    assert (c.state, c.hint) == (expected, hint)


@pytest.mark.parametrize(
    ("reason", "pending_for", "verdict"),
    [
        ("Priority", 1e6, "healthy"),
        ("Resources", 1e6, "healthy"),
        ("QOSMaxGRESPerUser", 1e6, "healthy"),
        ("AssocGrpGRES", 1e6, "healthy"),
        ("JobArrayTaskLimit", 1e6, "healthy"),
        ("BeginTime", 1e6, "healthy"),
        ("Dependency", 1e6, "healthy"),
        ("None", 1e6, "healthy"),
        ("SomeFutureReason", 1e6, "healthy"),
        ("PartitionDown", 0, "stuck"),
        ("PartitionInactive", 0, "stuck"),
        ("QOSJobLimit", 0, "stuck"),
        ("DependencyNeverSatisfied", 0, "stuck"),
        ("InvalidAccount", 0, "stuck"),
        ("JobHeldAdmin", 0, "stuck"),
        ("launch failed requeued held", 0, "stuck"),
        ("ReqNodeNotAvail, UnavailableNodes:n[1-2]", 60, "healthy"),
        ("ReqNodeNotAvail, UnavailableNodes:n[1-2]", 3600, "stuck"),
        ("NodeDown", 3600, "stuck"),
    ],
)
def test_pending_reasons(reason: str, pending_for: float, verdict: str) -> None:
    assert pending_verdict(reason, pending_for) == verdict


# --- resolve_task: one tracked task after a poll ----------------------------------------------------------

QUEUE = read_squeue(
    0,
    "7_0|8|7|0|RUNNING|None\n"
    "7_1|7|7|1|PENDING|PartitionDown\n"
    "7_2|9|7|2|COMPLETED|None\n"
    "7_3|10|7|3|TIMEOUT|TimeLimit\n"
    "7_4|11|7|4|CANCELLED|None\n"
    "7_5|12|7|5|PENDING|Priority\n"
    "7_6|13|7|6|WEIRD_NEW|None\n",
    "",
    ["7"],
)
UNKNOWN = read_squeue(
    1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)", ["7"]
)
DISABLED = read_sacct(1, "", "Slurm accounting storage is disabled")
ACCT_DOWN = read_sacct(1, "", "sacct: error: slurmdbd: Connection refused")
ACCT = read_sacct(
    0,
    "9|7_2|FAILED|0:125|00:01:00|a|b|n\n14|7_9|CANCELLED by 0|0:0|00:00:00|a|b|n\n15|7_4|CANCELLED by 1000|0:15|00:00:03|a|b|n\n",
    "",
)


@pytest.mark.parametrize(
    ("task", "exit_code", "queue", "acct", "expected"),
    [
        # The exit file decides, whatever the queue says (or fails to say).
        (0, 0, QUEUE, None, Resolution("done", "COMPLETED", exit_code=0)),
        (0, 0, UNKNOWN, None, Resolution("done", "COMPLETED", exit_code=0)),
        (3, 143, QUEUE, None, Resolution("done", "TIMEOUT", exit_code=143)),
        (0, 1, QUEUE, None, Resolution("done", "FAILED", exit_code=1)),
        # A failed query is unknown, never gone: nothing changes.
        (0, None, UNKNOWN, None, Resolution("wait")),
        (9, None, UNKNOWN, None, Resolution("wait")),
        (0, None, None, None, Resolution("wait")),
        # Listed and alive.
        (0, None, QUEUE, None, Resolution("wait", "RUNNING")),
        (5, None, QUEUE, None, Resolution("wait", "PENDING")),
        (6, None, QUEUE, None, Resolution("wait")),
        # A reason that never clears wakes the sleep.
        (
            1,
            None,
            QUEUE,
            None,
            Resolution("stuck", "PENDING", "pending with the reason 'PartitionDown', which does not clear"),
        ),
        # Ended without an exit file: the scheduler's reason.
        (3, None, QUEUE, None, Resolution("done", "TIMEOUT")),
        # COMPLETED without an exit file contradicts the wrapper: ask accounting, then decide.
        (2, None, QUEUE, None, Resolution("ask_accounting", "COMPLETED")),
        (2, None, QUEUE, ACCT, Resolution("done", "OUT_OF_MEMORY", exit_code=0, signal=125)),
        (
            2,
            None,
            QUEUE,
            DISABLED,
            Resolution("done", "VANISHED", "Slurm says COMPLETED but the job wrote no exit file"),
        ),
        # Cancelled outside the kernel: accounting says by whom.
        (4, None, QUEUE, None, Resolution("ask_accounting", "CANCELLED")),
        (
            4,
            None,
            QUEUE,
            ACCT,
            Resolution(
                "done",
                "CANCELLED",
                "cancelled with scancel outside the kernel (uid 1000)",
                exit_code=0,
                signal=15,
            ),
        ),
        (
            4,
            None,
            QUEUE,
            DISABLED,
            Resolution("done", "CANCELLED", "cancelled outside the kernel (by scancel or the scheduler)"),
        ),
        # Gone from the queue without an exit file.
        (8, None, QUEUE, None, Resolution("ask_accounting")),
        (8, None, QUEUE, DISABLED, Resolution("done", "VANISHED", VANISHED_HINT)),
        (8, None, QUEUE, ACCT, Resolution("done", "VANISHED", VANISHED_HINT)),
        (8, None, QUEUE, ACCT_DOWN, Resolution("wait")),
        (
            9,
            None,
            QUEUE,
            ACCT,
            Resolution(
                "done",
                "CANCELLED",
                "cancelled by the scheduler or an administrator (uid 0), not by you",
                exit_code=0,
                signal=0,
            ),
        ),
    ],
)
def test_resolve_task(
    task: int, exit_code: int | None, queue: object, acct: object, expected: Resolution
) -> None:
    got = resolve_task(("7", task), exit_code=exit_code, queue=queue, accounting=acct, our_uid=ME)  # type: ignore[arg-type]
    assert got == expected


def test_resolve_cancel_by_the_kernel_needs_no_accounting() -> None:
    got = resolve_task(("7", 4), exit_code=None, queue=QUEUE, cancelled_by_kernel=True)
    assert got == Resolution("done", "CANCELLED")


def test_gone_single_job_via_the_single_id_pitfall() -> None:
    gone = read_squeue(1, "", "slurm_load_jobs error: Invalid job id specified", ["42"])
    assert resolve_task(("42", None), exit_code=None, queue=gone) == Resolution("ask_accounting")
    assert resolve_task(("42", None), exit_code=0, queue=gone) == Resolution("done", "COMPLETED", exit_code=0)


def test_preempted_and_requeued_is_not_failed() -> None:
    q = read_squeue(0, "50|50|50|N/A|PREEMPTED|None\n", "", ["50", "51"])
    assert resolve_task(("50", None), exit_code=None, queue=q, requeues=True).action == "wait"
    assert resolve_task(("50", None), exit_code=None, queue=q, requeues=False) == Resolution(
        "done", "PREEMPTED"
    )


def test_a_whole_poll_resolves_every_task_from_one_squeue() -> None:
    q = read_squeue(0, "3_[0-3%2]|3|3|0-3%2|PENDING|None\n", "", ["3"])
    assert {resolve_task(("3", k), exit_code=None, queue=q).state for k in range(4)} == {"PENDING"}
    acct = parse_sacct("4|3_0|COMPLETED|0:0|00:00:01|a|b|n\n")
    assert acct[("3", 0)].state == "COMPLETED"
    assert parse_squeue("") == {}


# --- poll interval -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("since_change", "failures", "expected"),
    [
        (0, 0, 2.0),
        (15, 0, 2.0),
        (100, 0, 10.0),
        (300, 0, 30.0),
        (3600, 0, 60.0),
        (0, 1, 4.0),
        (0, 3, 16.0),
        (0, 10, 60.0),
        (0, 10_000, 60.0),
    ],
)
def test_poll_interval(since_change: float, failures: int, expected: float) -> None:
    assert poll_interval(since_change, failures) == expected


def test_poll_interval_never_leaves_its_bounds() -> None:
    values = [
        poll_interval(s, f, floor_s=1, ceiling_s=30) for s in range(0, 10_000, 37) for f in range(0, 40, 3)
    ]
    assert min(values) == 1
    assert max(values) == 30


@pytest.mark.parametrize(("floor", "ceiling"), [(0, 10), (-1, 10), (5, 4)])
def test_poll_interval_refuses_bad_bounds(floor: float, ceiling: float) -> None:
    with pytest.raises(ValueError, match="poll interval bounds"):
        poll_interval(0, floor_s=floor, ceiling_s=ceiling)
