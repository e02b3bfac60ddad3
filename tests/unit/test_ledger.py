"""The ledger decides every amount, in exact integers, and nothing outside it does.

Refusals say what is short and charge nothing; a finished task's release spends at most what it held; for any
sequence of reserve/settle/refund the balance never goes negative and charged = used + refunded + still reserved.
The scan at the end keeps the ledger the one home of budget arithmetic.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channel.decode import RequestError
from channel.messages import Launch
from kernel.core import ledger
from kernel.core.budget import Balance, gpu_hours, gpu_seconds
from kernel.core.records import JobRow


def L(name: str, gpus: int = 1, minutes: int = 30, array: int = 1) -> Launch:
    return Launch(name=name, command="true", gpus=gpus, minutes=minutes, array=array)


def task(gpus: int = 1, minutes: int = 60, reserved: int | None = None) -> JobRow:
    held = ledger.task_reservation(gpus, minutes) if reserved is None else reserved
    return JobRow("w-1", 1, "a", 0, 1, 0, "x", minutes, gpus, (), "", held, "PENDING")


def test_gpu_hours_round_trip_exactly() -> None:
    assert gpu_seconds(1.5) == 5400
    assert gpu_hours(5400) == 1.5
    assert gpu_seconds(0.1) * 3 == gpu_seconds(0.3)
    with pytest.raises(ValueError, match="negative"):
        gpu_seconds(-1)


def test_a_reservation_is_the_whole_walltime_of_every_gpu() -> None:
    assert ledger.task_reservation(2, 30) == 3600
    assert ledger.launch_reservation(L("a", gpus=2, minutes=30, array=4)) == 4 * 3600
    assert ledger.task_reservation(0, 600) == 0


def test_measured_use_rounds_up_and_ignores_cpu_jobs_and_tasks_that_never_ran() -> None:
    assert ledger.measured_use(2, 1.2) == 3
    assert ledger.measured_use(0, 100.0) == 0
    assert ledger.measured_use(1, None) == 0
    assert ledger.measured_use(1, -5.0) == 0


def test_reserve_counts_launches_not_array_tasks_and_reserves_gpu_time() -> None:
    b = Balance(launches=10, sleeps=3, gpu_s=gpu_seconds(10))
    after = ledger.reserve_sleep(b, (L("a", gpus=2, minutes=30, array=4), L("b", gpus=0)))
    assert (after.launches, after.sleeps) == (8, 2)
    assert after.reserved_gpu_s == 2 * 30 * 60 * 4
    assert after.gpu_s + after.reserved_gpu_s == b.gpu_s
    assert after.to_message().reserved_gpu_hours == 4.0


def test_checkpoint_costs_one_sleep_only() -> None:
    after = ledger.reserve_sleep(Balance(1, 1, 0), ())
    assert after == Balance(1, 0, 0)


@pytest.mark.parametrize(
    ("balance", "launches", "code"),
    [
        (Balance(5, 0, 10**6), (), "budget.sleeps"),
        (Balance(1, 5, 10**6), (L("a"), L("b")), "budget.launches"),
        (Balance(5, 5, 1799), (L("a", gpus=1, minutes=30),), "budget.gpu_hours"),
    ],
)
def test_refusals_name_what_is_short(balance: Balance, launches: tuple[Launch, ...], code: str) -> None:
    with pytest.raises(RequestError) as info:
        ledger.reserve_sleep(balance, launches)
    assert info.value.code == code


def test_exactly_the_last_gpu_second_can_be_spent() -> None:
    after = ledger.reserve_sleep(Balance(5, 5, 1800), (L("a", gpus=1, minutes=30),))
    assert after.gpu_s == 0


def test_an_evaluation_reserves_gpu_time_but_no_launch() -> None:
    after = ledger.reserve_eval(Balance(3, 2, 7200), (task(), task()))
    assert after == Balance(3, 2, 0, 7200)
    with pytest.raises(RequestError) as info:
        ledger.reserve_eval(Balance(3, 2, 7199), (task(), task()))
    assert (info.value.code, info.value.path) == ("budget.gpu_hours", "$.submit")


def test_a_finished_task_spends_what_it_used_capped_at_what_it_held() -> None:
    charged = ledger.reserve_sleep(Balance(10, 3, 7200), (L("a", gpus=1, minutes=60),))
    s = ledger.settle_task(charged, task(), 600.0)
    assert (s.balance, s.used_gpu_s, s.refunded_gpu_s) == (Balance(9, 2, 6600, 0), 600, 3000)
    s = ledger.settle_task(charged, task(), 10.0**9)
    assert (s.balance, s.used_gpu_s, s.refunded_gpu_s) == (Balance(9, 2, 3600, 0), 3600, 0)
    # refunded earlier (cancelled before dispatch): holds nothing, uses nothing, its whole reservation refunded
    s = ledger.settle_task(charged, task(reserved=0), 50.0)
    assert (s.balance, s.used_gpu_s, s.refunded_gpu_s) == (charged, 0, 3600)
    with pytest.raises(ValueError, match="only 3600"):
        ledger.settle_task(charged, task(reserved=3601), 0.0)


def test_refunds_undo_a_charge() -> None:
    b = Balance(10, 3, 7200)
    charged = ledger.reserve_sleep(b, (L("a", gpus=1, minutes=60),))
    assert ledger.refund_rejected_sleep(charged, 1, [task()]) == b
    assert ledger.refund_unrun(charged, task()) == Balance(9, 2, 7200, 0)
    assert ledger.refund_sleep_count(charged) == Balance(9, 3, 3600, 3600)
    with pytest.raises(ValueError, match="only 3600"):
        ledger.refund_rejected_sleep(charged, 1, [task(), task()])


def test_grants_keep_what_running_work_holds() -> None:
    b = Balance(1, 2, 300, 60)
    assert ledger.opening(5, 6, 7) == Balance(5, 6, 7, 0)
    assert ledger.granted(b, sleeps=9) == Balance(1, 9, 300, 60)
    assert ledger.granted(b) == b
    assert ledger.edited(b, {"launches": 4}, {"gpu_s": -300, "sleeps": 1}) == Balance(4, 3, 0, 60)
    with pytest.raises(ledger.Overdrawn) as info:
        ledger.edited(b, {}, {"gpu_s": -301})
    assert info.value.column == "gpu_s"


def test_a_balance_never_goes_negative() -> None:
    with pytest.raises(ValueError, match="negative"):
        Balance(-1, 0, 0)


# --- conservation -------------------------------------------------------------------------------------------

launches_st = st.lists(
    st.builds(
        L,
        name=st.sampled_from(["a", "b", "c"]),
        gpus=st.integers(0, 4),
        minutes=st.integers(1, 120),
        array=st.integers(1, 3),
    ),
    max_size=3,
)
# One step: reserve a sleep (its tasks become held), or pick a held task and settle it (with a measured elapsed
# time, possibly past its walltime or missing), refund it unrun, or reject the sleep it belongs to.
steps_st = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), launches_st),
        st.tuples(
            st.just("settle"), st.integers(0, 50), st.one_of(st.none(), st.floats(0, 20_000, allow_nan=False))
        ),
        st.tuples(st.just("unrun"), st.integers(0, 50)),
        st.tuples(st.just("reject"), st.integers(0, 50)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    start=st.builds(Balance, st.integers(0, 6), st.integers(0, 6), st.integers(0, 40_000)),
    steps=steps_st,
)
def test_conservation_charged_is_used_plus_refunded_plus_reserved(start: Balance, steps: list[tuple]) -> None:
    balance = start
    sleeps: list[tuple[int, list[JobRow]]] = []  # (launches charged, its tasks as the store holds them)
    charged = used = refunded = 0
    for step in steps:
        if step[0] == "reserve":
            try:
                after = ledger.reserve_sleep(balance, tuple(step[1]))
            except RequestError:
                continue  # a refusal charges nothing
            tasks = [
                JobRow("w", len(sleeps), x.name, i, x.array, 0, "c", x.minutes, x.gpus, (), "", 0, "PENDING")
                for x in step[1]
                for i in range(x.array)
            ]
            tasks = [replace(t, reserved_gpu_s=ledger.task_reservation(t.gpus, t.minutes)) for t in tasks]
            charged += after.reserved_gpu_s - balance.reserved_gpu_s
            balance = after
            sleeps.append((len(step[1]), tasks))
            continue
        held = [(s, i) for s, (_, ts) in enumerate(sleeps) for i, t in enumerate(ts) if t.reserved_gpu_s > 0]
        if not held:
            continue
        s, i = held[step[1] % len(held)]
        t = sleeps[s][1][i]
        if step[0] == "settle":
            out = ledger.settle_task(balance, t, step[2])
            assert 0 <= out.used_gpu_s <= t.reserved_gpu_s
            used += out.used_gpu_s
            refunded += t.reserved_gpu_s - out.used_gpu_s
            balance = out.balance
            sleeps[s][1][i] = replace(t, reserved_gpu_s=0)
        elif step[0] == "unrun":
            balance = ledger.refund_unrun(balance, t)
            refunded += t.reserved_gpu_s
            sleeps[s][1][i] = replace(t, reserved_gpu_s=0)
        else:  # reject the whole sleep: only one nothing of which has run or been refunded
            launches, tasks = sleeps[s]
            if any(x.reserved_gpu_s != ledger.task_reservation(x.gpus, x.minutes) for x in tasks):
                continue
            before = balance
            balance = ledger.refund_rejected_sleep(balance, launches, tasks)
            assert (balance.launches, balance.sleeps) == (before.launches + launches, before.sleeps + 1)
            refunded += sum(x.reserved_gpu_s for x in tasks)
            sleeps[s] = (launches, [replace(x, reserved_gpu_s=0) for x in tasks])
        assert min(balance.launches, balance.sleeps, balance.gpu_s, balance.reserved_gpu_s) >= 0
        assert charged == used + refunded + balance.reserved_gpu_s
        assert balance.gpu_s + balance.reserved_gpu_s + used == start.gpu_s + start.reserved_gpu_s
    assert balance.reserved_gpu_s == start.reserved_gpu_s + sum(
        t.reserved_gpu_s for _, ts in sleeps for t in ts
    )


# --- one home -----------------------------------------------------------------------------------------------

KERNEL = Path(__file__).resolve().parents[2] / "kernel"
LEDGER = KERNEL / "core" / "ledger.py"
# The store reads a balance back from its row (nothing decided there); every other Balance is made by the ledger.
READS_BALANCE_ROWS = {KERNEL / "io" / "store.py"}
BUDGET_FIELDS = {"launches", "sleeps", "gpu_s", "reserved_gpu_s"}


def _ident(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _product(node: ast.BinOp) -> list[ast.expr]:
    """The factors of a chain of `*`."""
    out: list[ast.expr] = []
    for side in (node.left, node.right):
        if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult):
            out += _product(side)
        else:
            out.append(side)
    return out


def _is_time(node: ast.AST) -> bool:
    for n in ast.walk(node):
        name = _ident(n)
        if name == "minutes" or (name or "").startswith("elapsed"):
            return True
        if isinstance(n, ast.Constant) and n.value in (60, 3600):
            return True
    return False


def budget_arithmetic(source: str, *, may_make_balance: bool = False) -> list[str]:
    """Budget decisions made in `source`: GPU-time products (gpus x minutes/elapsed/60, or minutes x 60),
    arithmetic on a balance's or a task's budget fields, sums of reservations, `replace(..., <budget field>=)`,
    and `Balance(...)` (unless `may_make_balance`). Each as 'line: what'."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            factors = _product(node)
            names = [_ident(f) for f in factors]
            if "gpus" in names and any(_is_time(f) for f in factors if _ident(f) != "gpus"):
                found.append(f"{line}: GPU-time product")
            elif "minutes" in names and any(isinstance(f, ast.Constant) and f.value == 60 for f in factors):
                found.append(f"{line}: minutes x 60")
        if isinstance(node, ast.BinOp | ast.AugAssign):
            sides = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
            if any(isinstance(x, ast.Attribute) and x.attr in BUDGET_FIELDS for x in sides):
                found.append(f"{line}: arithmetic on a budget field")
        if isinstance(node, ast.Call):
            fname = _ident(node.func)
            if fname == "sum" and any(
                isinstance(n, ast.Attribute) and n.attr in {"reserved_gpu_s", "gpu_s"}
                for a in node.args
                for n in ast.walk(a)
            ):
                found.append(f"{line}: sum of reservations")
            if fname == "replace" and any(k.arg in BUDGET_FIELDS for k in node.keywords):
                found.append(f"{line}: replace() of a budget field")
            if fname == "Balance" and not may_make_balance:
                found.append(f"{line}: Balance(...) made")
    return list(dict.fromkeys(found))  # a product of three factors is seen at each of its two `*`


def test_the_scan_sees_each_kind_of_budget_decision() -> None:
    example = """
cost = cur.gpus * cur.minutes * 60
used = gpus * max(0.0, elapsed_s)
walltime = job.minutes * 60
balance = replace(balance, sleeps=balance.sleeps + 1)
refund = sum(j.reserved_gpu_s for j in jobs)
done = replace(j, state=state, reserved_gpu_s=0)
b = Balance(1, 2, 3)
b.gpu_s -= 5
"""
    kinds = Counter(f.split(": ", 1)[1] for f in budget_arithmetic(example))
    assert kinds == {
        "GPU-time product": 2,
        "minutes x 60": 1,
        "replace() of a budget field": 2,
        "arithmetic on a budget field": 2,
        "sum of reservations": 1,
        "Balance(...) made": 1,
    }
    # what is not a budget decision: a Slurm resource request, a walltime in seconds, a grace period
    innocent = """
cpus = max(policy.cpus_per_task, job.gpus * policy.cpus_per_gpu)
walltime = spec.minutes * self.seconds_per_minute
cutoff = self.clock() - self.cfg.temp_grace_minutes * 60
n = len(req.launches)
"""
    assert budget_arithmetic(innocent) == []


def test_the_ledger_is_the_one_home_of_budget_arithmetic() -> None:
    found = []
    for path in sorted(KERNEL.rglob("*.py")):
        if path == LEDGER:
            continue
        rel = path.relative_to(KERNEL.parent)
        found += [
            f"{rel}:{x}"
            for x in budget_arithmetic(path.read_text(), may_make_balance=path in READS_BALANCE_ROWS)
        ]
    assert not found, (
        "budget amounts decided outside kernel/core/ledger.py (ask the ledger, apply its answer):\n"
        + "\n".join(found)
    )
