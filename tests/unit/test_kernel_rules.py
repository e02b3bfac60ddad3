"""The pipeline's pure decisions: sleep acceptance, cancel planning, answers, and pass fairness."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as hs

from channel.decode import RequestError
from channel.messages import CancelRequest, KernelRef, Launch, Policy, SleepRequest, Verdict
from channel.safefs import Identity
from kernel.core.budget import Balance
from kernel.core.records import JobRow, SleepRow, WorkspaceRow
from kernel.core.rules import (
    Sleep,
    accept_sleep,
    cancelled_by,
    history_answer,
    plan_cancel,
    plan_pass,
    queue_answer,
    status_answer,
)

NOW = "2026-11-30T12:00:00.000Z"


DEFAULT_BALANCE = Balance(10, 5, 36000)
DEFAULT_POLICY = Policy()


def ws(balance: Balance = DEFAULT_BALANCE, policy: Policy = DEFAULT_POLICY) -> WorkspaceRow:
    return WorkspaceRow("w-1", "/w", Identity(1, 2, 3), balance, policy, "sha", "inotify", NOW, None)


def sleep_req(*launches: Launch) -> SleepRequest:
    return SleepRequest(protocol=1, id="s1", launches=launches)


def sleep_row(seq: int = 1, state: str = "validated") -> SleepRow:
    return SleepRow("w-1", seq, f"s{seq}", state, "", None, NOW, None, None)


def flying(seq: int = 1, *jobs: JobRow, state: str = "running") -> Sleep:
    """A sleep in flight with its tasks."""
    return (sleep_row(seq, state), jobs)


def test_accept_records_one_pending_task_per_array_index() -> None:
    acc = accept_sleep(
        ws(), (), sleep_req(Launch(name="a", command="x", gpus=1, minutes=10, array=3)), 1, NOW
    )
    assert [(j.launch, j.task, j.state, j.reserved_gpu_s) for j in acc.jobs] == [
        ("a", 0, "PENDING", 600),
        ("a", 1, "PENDING", 600),
        ("a", 2, "PENDING", 600),
    ]
    assert acc.balance == Balance(9, 4, 36000 - 1800, 1800)


@pytest.mark.parametrize(
    ("policy", "launch", "in_flight", "code"),
    [
        (Policy(max_minutes=10), Launch(name="a", command="x", minutes=11), (), "policy.minutes"),
        (Policy(max_gpus=1), Launch(name="a", command="x", gpus=2), (), "policy.gpus"),
        (Policy(max_sleeps_in_flight=1), Launch(name="a", command="x"), (flying(),), "sleep.in_progress"),
        # policy is checked before state: the cheapest, most specific refusal first
        (Policy(max_gpus=0), Launch(name="a", command="x", gpus=1), (flying(),), "policy.gpus"),
    ],
)
def test_refusals(policy: Policy, launch: Launch, in_flight: tuple[Sleep, ...], code: str) -> None:
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(policy=policy), in_flight, sleep_req(launch), 2, NOW)
    assert info.value.code == code


def test_sleeps_in_flight_up_to_the_policy_limit() -> None:
    two = (flying(1), flying(2))
    acc = accept_sleep(
        ws(policy=Policy(max_sleeps_in_flight=3)), two, sleep_req(Launch(name="a", command="x")), 3, NOW
    )
    assert [(j.seq, j.launch) for j in acc.jobs] == [(3, "a")]
    # each sleep is charged its own sleep and launches
    assert acc.balance == Balance(9, 4, 36000)
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(policy=Policy(max_sleeps_in_flight=2)), two, sleep_req(), 3, NOW)
    assert (info.value.code, info.value.message) == (
        "sleep.in_progress",
        "already 2 sleeps in flight (max_sleeps_in_flight 2): 's1' (seq 1), 's2' (seq 2); wait for a wake, or "
        "cancel a sleep's launches",
    )


def test_one_sleep_in_flight_by_default_limit_message() -> None:
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(policy=Policy(max_sleeps_in_flight=1)), (flying(4),), sleep_req(), 5, NOW)
    assert info.value.message.startswith("already 1 sleep in flight (max_sleeps_in_flight 1): 's4' (seq 4);")


def test_the_default_policy_allows_several_sleeps_in_flight() -> None:
    assert Policy().max_sleeps_in_flight == 4
    accept_sleep(ws(), (flying(1), flying(2), flying(3)), sleep_req(), 4, NOW)


def test_one_submit_in_flight_at_a_time() -> None:
    from channel.messages import EvalContract, Submit

    contract = Policy(submit=EvalContract(command="python eval.py", metric="acc"))
    req = SleepRequest(protocol=1, id="s3", submit=Submit(report="r"))
    with_submit = (replace(sleep_row(1, "running"), submit=b"{}"), ())
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(policy=contract), (with_submit,), req, 3, NOW)
    assert (info.value.code, info.value.path) == ("sleep.in_progress", "$.submit")
    assert "carries a submit; one submit at a time" in info.value.message
    # beside a sleep without a submit it is accepted
    accept_sleep(ws(policy=contract), (flying(1),), req, 3, NOW)


def test_the_gpu_ceiling_holds_across_sleeps_in_flight() -> None:
    # max_concurrent_gpus 4: a sleep in flight whose two live 1-GPU tasks run at once holds 2
    policy = Policy(max_gpus=4, max_concurrent_gpus=4)
    held = flying(1, job("a", 0, "RUNNING", "1_0"), job("a", 1, "RUNNING", "1_1"), job("a", 2, "COMPLETED"))
    two = sleep_req(Launch(name="b", command="x", gpus=2))
    acc = accept_sleep(ws(policy=policy), (held,), two, 2, NOW)  # 2 + 2 <= 4
    assert [(j.gpus, j.width) for j in acc.jobs] == [(2, 1)]
    three = sleep_req(Launch(name="b", command="x", gpus=3))
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(policy=policy), (held,), three, 2, NOW)
    assert (info.value.code, info.value.message) == (
        "sleep.in_progress",
        "the 1 sleep in flight holding GPUs ('s1' (seq 1)) may hold 2 GPUs at once, leaving 2 of this "
        "workspace's max_concurrent_gpus (4), and one task of this sleep's GPU launch needs 3; wait for a wake "
        "(or cancel a sleep's launches), or launch with fewer GPUs per task",
    )
    # a sleep without GPUs is never held back by them; alone, a sleep is as before (its launches clamped)
    accept_sleep(ws(policy=policy), (held,), sleep_req(Launch(name="c", command="x")), 2, NOW)
    alone = accept_sleep(
        ws(policy=policy), (), sleep_req(Launch(name="b", command="x", gpus=4, array=4)), 2, NOW
    )
    assert {j.width for j in alone.jobs} == {1}


def test_a_new_sleep_gets_the_gpus_the_sleeps_in_flight_leave() -> None:
    """Cap 8, a sleep in flight holding 2 (2 live 1-GPU tasks at once): a `--gpus 1 --array 10` sleep is
    accepted with 6 at a time, not refused, and the 8 together are never exceeded."""
    policy = Policy(max_gpus=8, max_concurrent_gpus=8)
    held = flying(1, job("a", 0, "RUNNING", "1_0"), job("a", 1, "PENDING"))
    acc = accept_sleep(
        ws(policy=policy), (held,), sleep_req(Launch(name="b", command="x", gpus=1, array=10)), 2, NOW
    )
    assert {j.width for j in acc.jobs} == {6}
    from kernel.core.rules import gpus_at_once

    assert gpus_at_once(held[1], 8) + gpus_at_once(acc.jobs, 8) == 8


def test_two_gpu_launches_of_one_sleep_share_the_ceiling() -> None:
    """The defect: cap 8, two `--gpus 4 --array 8` launches each ran 2 at a time (16 GPUs). Now 1 each, and
    the widths are on every row of their launch; a CPU launch beside them keeps its whole array."""
    from kernel.core.rules import gpus_at_once

    req = sleep_req(
        Launch(name="a", command="x", gpus=4, array=8),
        Launch(name="b", command="x", gpus=4, array=8),
        Launch(name="c", command="x", array=5),
    )
    acc = accept_sleep(ws(Balance(10, 5, 10**9), Policy(max_concurrent_gpus=8)), (), req, 1, NOW)
    assert {(j.launch, j.width) for j in acc.jobs} == {("a", 1), ("b", 1), ("c", 5)}
    assert gpus_at_once(acc.jobs, 8) == 8


def test_a_sleep_whose_gpu_launches_never_fit_is_refused_by_policy() -> None:
    req = sleep_req(*(Launch(name=n, command="x", gpus=4) for n in "abc"))
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(policy=Policy(max_concurrent_gpus=8)), (), req, 1, NOW)
    assert (info.value.code, info.value.path, info.value.message) == (
        "policy.concurrent_gpus",
        "$.launches[2].gpus",
        "this sleep's 3 GPU launches need at least 12 GPUs at once (one task of each: a 4, b 4, c 4), above this "
        "workspace's max_concurrent_gpus (8): put some of them in another sleep, or ask fewer GPUs per task",
    )


def test_a_submits_gpu_evaluation_runs_share_the_ceiling_with_the_launches() -> None:
    from channel.messages import EvalContract, Submit

    contract = EvalContract(command="python eval.py", metric="acc", gpus=2, repeats=3)
    policy = Policy(max_concurrent_gpus=8, submit=contract)
    req = SleepRequest(
        protocol=1,
        id="s1",
        launches=(Launch(name="t", command="x", gpus=2, array=4),),
        submit=Submit(report="r"),
    )
    acc = accept_sleep(ws(Balance(10, 5, 10**9), policy), (), req, 1, NOW)
    widths = {(j.launch, j.width) for j in acc.jobs}
    assert widths == {("t", 2), ("submit-base", 1), ("submit-candidate", 1)}
    big = msgspec.structs.replace(req, launches=(Launch(name="t", command="x", gpus=5),))
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(Balance(10, 5, 10**9), policy), (), big, 1, NOW)
    assert (info.value.code, info.value.path) == ("policy.concurrent_gpus", "$.submit")
    assert info.value.message.startswith(
        "this sleep's 3 GPU launches (its submit's 2 evaluation runs among them) need at least 9 GPUs at once "
        "(one task of each: t 5, submit-base 2, submit-candidate 2)"
    )


@pytest.mark.parametrize(
    ("left", "launches", "want"),
    [
        (8, [(4, 8), (4, 8)], (1, 1)),
        (8, [(1, 8), (1, 8)], (4, 4)),
        (8, [(1, 2), (1, 8)], (2, 6)),  # what one launch does not take goes to the others
        (7, [(2, 8), (1, 8)], (2, 3)),  # one each (3 GPUs), then one more each (6), then only b's task fits
        (3, [(4, 1)], None),
        (8, [(3, 3), (3, 3), (3, 3)], None),
        (0, [], ()),
        (5, [(1, 1)], (1,)),  # never above what it asked for
    ],
)
def test_share_gpus(left: int, launches: list[tuple[int, int]], want: tuple[int, ...] | None) -> None:
    from kernel.core.rules import share_gpus

    assert share_gpus(left, launches) == want


@given(
    hs.integers(0, 64),
    hs.lists(hs.tuples(hs.integers(1, 8), hs.integers(1, 16)), max_size=6),
)
def test_share_gpus_stays_within_what_is_left_and_leaves_nothing_a_task_could_use(
    left: int, launches: list[tuple[int, int]]
) -> None:
    from kernel.core.rules import share_gpus

    got = share_gpus(left, launches)
    if got is None:  # only when one task of each does not fit
        assert sum(g for g, _ in launches) > left
        return
    used = sum(g * w for (g, _), w in zip(launches, got, strict=True))
    assert used <= left
    assert all(1 <= w <= most for (_, most), w in zip(launches, got, strict=True))
    # maximal: every launch that would run more has a task larger than what is left
    assert all(w == most or g > left - used for (g, most), w in zip(launches, got, strict=True))


def test_a_gathered_sleep_has_nothing_left_to_cancel() -> None:
    # its wake may already be read: a cancel naming it is answered as after `woken`, not as one that stopped
    # nothing
    gathered = (sleep_row(state="gathered"), [job("a", 0, "COMPLETED")])
    with pytest.raises(RequestError) as info:
        plan_cancel(ws(), (), gathered, CancelRequest(protocol=1, id="c", sleep="s1"))
    assert (info.value.code, info.value.path) == ("cancel.no_sleep", "$.sleep")
    assert info.value.message == "sleep 's1' (seq 1) has woken; nothing of it is left to cancel"


def test_budget_is_checked_after_state() -> None:
    with pytest.raises(RequestError) as info:
        accept_sleep(ws(Balance(0, 0, 0)), (), sleep_req(), 1, NOW)
    assert info.value.code == "budget.sleeps"


def job(
    launch: str, task: int, state: str = "PENDING", job_id: str | None = None, reserved: int = 600
) -> JobRow:
    return JobRow("w-1", 1, launch, task, 2, 0, "x", 10, 1, (), "", reserved, state, job_id=job_id)


def test_cancel_refunds_unsubmitted_tasks_and_leaves_submitted_ones_to_the_executor() -> None:
    jobs = [job("a", 0), job("a", 1, "RUNNING", "42_1"), job("b", 0), job("b", 1, "COMPLETED")]
    w = ws(Balance(5, 4, 1000, 2400))
    plan = plan_cancel(w, [(sleep_row(), jobs)], None, CancelRequest(protocol=1, id="c", launches=("a",)))
    assert [(j.launch, j.task) for j in plan.targets] == [("a", 0), ("a", 1)]
    # as read: the pipeline moves them PENDING -> CANCELLED by compare-and-set in the cancel's transaction
    assert [(j.launch, j.task, j.state, j.reserved_gpu_s) for j in plan.now_cancelled] == [
        ("a", 0, "PENDING", 600)
    ]
    assert plan.balance == Balance(5, 4, 1600, 1800)
    everything = plan_cancel(w, [(sleep_row(), jobs)], None, CancelRequest(protocol=1, id="c"))
    assert len(everything.targets) == 3


def stopped(j: JobRow, recorded: str, ended: str | None = None) -> JobRow:
    """`j` as the kernel records it CANCELLED at `recorded` (its clock); `ended`: the backend's end time."""
    return replace(j, state="CANCELLED", updated_at=recorded, ended_at=ended or recorded)


def test_a_cancel_answers_only_what_it_stopped() -> None:
    earlier, mine, later = "2026-11-30T12:00:00.000Z", "2026-11-30T12:00:05.000Z", "2026-11-30T12:00:09.000Z"
    jobs = [
        stopped(job("a", 0), earlier),  # an earlier cancel stopped it
        stopped(job("a", 1), mine),  # this cancel's own transaction stopped it
        job("a", 2, "RUNNING", "42_2"),  # the scheduler is stopping it now
        stopped(job("a", 3, job_id="42_3"), later),  # stopped by this cancel, recorded since
        replace(job("a", 4, "COMPLETED", "42_4"), ended_at=earlier, updated_at=earlier),
        job("b", 0, "RUNNING", "43"),
    ]
    assert [(j.launch, j.task) for j in cancelled_by(jobs, ("a",), mine)] == [("a", 1), ("a", 2), ("a", 3)]
    assert [(j.launch, j.task) for j in cancelled_by(jobs, (), mine)] == [
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("b", 0),
    ]
    assert cancelled_by(jobs[:2] + jobs[4:5], ("a",), later) == []  # a second cancel: nothing left to stop


def test_a_cancel_answer_does_not_trust_the_node_clock() -> None:
    """A Slurm node whose clock is behind the kernel's reports an end before the cancel was received; the task
    was still stopped by this cancel (the kernel recorded it after), so the answer lists it. A node clock ahead
    does not make an earlier cancel's task this one's."""
    earlier, mine, later = "2026-11-30T12:00:00.000Z", "2026-11-30T12:00:05.000Z", "2026-11-30T12:00:09.000Z"
    behind = stopped(job("a", 0, job_id="42_0"), later, ended="2026-11-30T12:00:03.000Z")
    ahead = stopped(job("a", 1, job_id="42_1"), earlier, ended="2026-11-30T12:00:07.000Z")
    assert [(j.launch, j.task) for j in cancelled_by([behind, ahead], (), mine)] == [("a", 0)]


def test_cancel_refusals() -> None:
    one = [(sleep_row(), [job("a", 0)])]
    with pytest.raises(RequestError) as info:
        plan_cancel(ws(), [], None, CancelRequest(protocol=1, id="c"))
    assert info.value.code == "cancel.no_sleep"
    with pytest.raises(RequestError) as info:
        plan_cancel(ws(), one, None, CancelRequest(protocol=1, id="c", launches=("a", "zz")))
    assert info.value.code == "cancel.unknown_launch"
    assert info.value.path == "$.launches[1]"
    with pytest.raises(RequestError) as info:
        plan_cancel(ws(), one, None, CancelRequest(protocol=1, id="c", sleep="nope"))
    assert (info.value.code, info.value.path) == ("cancel.unknown_sleep", "$.sleep")
    assert info.value.message == "this workspace has no sleep 'nope' (in flight: 's1' (seq 1))"
    # a workspace whose policy withholds `cancel` is refused before its state is looked at
    no_cancel = Policy(verbs=("sleep", "status"))
    with pytest.raises(RequestError) as info:
        plan_cancel(ws(policy=no_cancel), one, None, CancelRequest(protocol=1, id="c"))
    assert (info.value.code, info.value.path) == ("policy.verb_disabled", "$.type")


def test_a_cancel_with_several_sleeps_in_flight_names_one() -> None:
    a = (sleep_row(1, "running"), [job("train", 0, "RUNNING", "1")])
    b = (sleep_row(2, "running"), [replace(job("eval", 0, "RUNNING", "2"), seq=2)])
    with pytest.raises(RequestError) as info:
        plan_cancel(ws(), [a, b], None, CancelRequest(protocol=1, id="c"))
    assert (info.value.code, info.value.message) == (
        "cancel.which_sleep",
        "2 sleeps are in flight: 's1' (seq 1), 's2' (seq 2); name the one to cancel (`sleep`: its id)",
    )
    # by id, or by launch names only one of them has
    assert plan_cancel(ws(), [a, b], b, CancelRequest(protocol=1, id="c", sleep="s2")).sleep.seq == 2
    named = plan_cancel(ws(), [a, b], None, CancelRequest(protocol=1, id="c", launches=("train",)))
    assert (named.sleep.seq, [j.launch for j in named.targets]) == (1, ["train"])


def test_read_only_answers() -> None:
    k = KernelRef(name="syscall-kernel", version="0")
    started = JobRow("w-1", 1, "a", 0, 1, 0, "x", 10, 1, (), "why", 600, "RUNNING", started_at=NOW)
    st = status_answer("q", k, ws(), (sleep_row(), [started]), [(sleep_row(), [started])], 1796040010.0)
    assert st.sleep is not None
    assert st.sleep.tasks[0].elapsed_s == 10.0
    assert st.budget.gpu_hours == 10.0
    other = JobRow("w-2", 1, "b", 0, 1, 0, "x", 5, 0, (), "theirs", 0, "PENDING")
    assert [(b.id, b.tasks, b.ended) for b in st.in_flight] == [("s1", 1, 0)]
    q = queue_answer("q", "w-1", [started, other], 1796040010.0, {1: "s1"})
    assert [(e.mine, e.workspace, e.why, e.sleep) for e in q.jobs] == [
        (True, "w-1", "why", "s1"),
        (False, "w-2", "theirs", None),
    ]
    verdict = Verdict(outcome="improved", metric="acc", direction="higher")
    import msgspec

    woken = SleepRow("w-1", 2, "s2", "woken", "n", None, NOW, NOW, msgspec.json.encode(verdict))
    h = history_answer("q", [(woken, [job("a", 0, "COMPLETED"), job("a", 1, "FAILED")]), (sleep_row(), [])])
    assert h.sleeps[0].verdict == "improved"
    assert h.sleeps[0].launches[0].states == ("COMPLETED", "FAILED")
    assert h.sleeps[1].launches == ()


def test_plan_pass_is_bounded_and_round_robin() -> None:
    pending = {"flood": 10_000, "b": 1, "c": 3}
    plan, after = plan_pass(pending, None, per_workspace=2, per_pass=100)
    assert plan == [("b", 1), ("c", 2), ("flood", 2)]
    assert after == "flood"


def test_plan_pass_cut_off_workspaces_go_first_next_time() -> None:
    pending = {k: 50 for k in "abcdef"}
    plan, after = plan_pass(pending, None, per_workspace=4, per_pass=10)
    assert plan == [("a", 4), ("b", 4), ("c", 2)]
    plan, after = plan_pass(pending, after, per_workspace=4, per_pass=10)
    assert plan == [("d", 4), ("e", 4), ("f", 2)]
    plan, _ = plan_pass(pending, after, per_workspace=4, per_pass=10)
    assert plan[0][0] == "a"


def test_a_flood_never_delays_a_quiet_workspace_by_more_than_one_pass() -> None:
    """Whatever the flood, a workspace with one request is served within two passes."""
    after = None
    for flood in (10, 1000, 10**6):
        pending = {"aaa-flood": flood, "zzz-quiet": 1}
        served = set()
        for _ in range(2):
            plan, after = plan_pass(pending, after, per_workspace=8, per_pass=8)
            served |= {k for k, _ in plan}
        assert "zzz-quiet" in served


def test_plan_pass_with_nothing_to_do() -> None:
    assert plan_pass({"a": 0}, "x", 1, 1) == ([], "x")


def test_status_shows_each_launch_and_the_clamp_where_it_happens() -> None:
    """`--gpus 1 --array 3` under `max_concurrent_gpus = 2`: status says 2 at a time and why, as the wake does."""
    clamped = [replace(job("s", t, "RUNNING", f"7_{t}"), array_size=3) for t in range(3)]
    free = [replace(job("f", t), array_size=3, gpus=0) for t in range(3)]
    st = status_answer(
        "q",
        KernelRef(name="k", version="1"),
        ws(policy=Policy(max_concurrent_gpus=2)),
        (sleep_row(state="running"), clamped + free),
        (),
        1796040010.0,
    )
    assert st.sleep is not None
    got = [(x.name, x.array, x.at_a_time, x.clamp) for x in st.sleep.launches]
    assert got == [
        (
            "s",
            3,
            2,
            "2 at a time, not all 3: this workspace runs at most 2 GPUs at once (max_concurrent_gpus) and each "
            "task takes 1 GPU",
        ),
        ("f", 3, 3, None),
    ]


def test_tail_of_an_earlier_sleeps_launch_says_what_it_reaches_and_where_the_logs_are() -> None:
    from channel.messages import TailRequest
    from kernel.core.rules import tail_target

    last = (replace(sleep_row(seq=3, state="woken"), id="s3"), [job("eval", 0)])
    with pytest.raises(RequestError) as e:
        tail_target((), None, last, TailRequest(protocol=1, id="t", launch="train"))
    assert e.value.code == "tail.unknown_task"
    assert e.value.message == (
        "'train' is not a launch of sleep 's3' (its launches: eval) (no sleep in flight has it); tail reaches the "
        "sleeps in flight, else the last one (sleep 3). An earlier sleep's logs were delivered when it woke, as its "
        "wake names them: "
        ".syscall/results/<seq>/<launch>/stdout (an array's task: .syscall/results/<seq>/<launch>/<task>/stdout; "
        "stderr beside it), at most the last log_max_bytes (kernel.json) of each"
    )


def test_status_and_tail_with_several_sleeps_in_flight() -> None:
    from channel.messages import StatusRequest, TailRequest
    from kernel.core.rules import status_target, tail_target

    a = (sleep_row(1, "running"), [job("train", 0, "RUNNING", "1")])
    b = (sleep_row(2, "running"), [replace(job("eval", 0, "RUNNING", "2"), seq=2)])
    # status: the newest in flight, or the one named; an unknown id is refused
    assert status_target([a, b], None, b, StatusRequest(protocol=1, id="q")) == b
    assert status_target([a, b], a, b, StatusRequest(protocol=1, id="q", sleep="s1")) == a
    with pytest.raises(RequestError) as e:
        status_target([a, b], None, b, StatusRequest(protocol=1, id="q", sleep="zz"))
    assert (e.value.code, e.value.path) == ("status.unknown_sleep", "$.sleep")
    # tail: the newest sleep in flight that has the launch
    sleep, task = tail_target([a, b], None, b, TailRequest(protocol=1, id="t", launch="train"))
    assert (sleep.seq, task.launch) == (1, "train")
    with pytest.raises(RequestError) as e:
        tail_target([a, b], b, b, TailRequest(protocol=1, id="t", launch="train", sleep="s2"))
    assert e.value.message == "'train' is not a launch of sleep 's2' (its launches: eval)"
    older = (sleep_row(1, "woken"), [job("train", 0, "COMPLETED")])
    with pytest.raises(RequestError) as e:
        tail_target([b], older, b, TailRequest(protocol=1, id="t", launch="train", sleep="s1"))
    assert (e.value.code, e.value.path) == ("tail.no_sleep", "$.sleep")


def test_a_sleep_woken_early_is_in_flight_and_a_refusal_says_it_woke_early() -> None:
    """A sleep whose early wake is recorded (early_gathered, early_woken) still runs tasks: it counts toward
    max_sleeps_in_flight, and the refusal names it as woken early with its tasks still running, never as a sleep
    that has not woken; once its rest has ended, as a sleep whose rest wake is being written."""
    running = (job("a", 0, "FAILED", "1"), job("a", 1, "RUNNING", "2"))
    for state in ("early_gathered", "early_woken"):
        with pytest.raises(RequestError) as err:
            accept_sleep(
                ws(policy=Policy(max_sleeps_in_flight=1)),
                (flying(4, *running, state=state),),
                sleep_req(),
                5,
                NOW,
            )
        assert err.value.code == "sleep.in_progress"
        assert "'s4' (seq 4; woke early, 1 task of it still running)" in err.value.message
        assert "`wakes/<id>.rest.md`, comes then" in err.value.message
        assert "has not woken" not in err.value.message
    ended = (job("a", 0, "FAILED", "1"), job("a", 1, "COMPLETED", "2"))
    with pytest.raises(RequestError) as err:
        accept_sleep(
            ws(policy=Policy(max_sleeps_in_flight=1)),
            (flying(4, *ended, state="early_woken"),),
            sleep_req(),
            5,
            NOW,
        )
    assert "'s4' (seq 4; woke early, and its rest wake is being written)" in err.value.message
