"""kernel.io.budgetorder: budget.json writes in the order of their balances' reads, per workspace."""

from __future__ import annotations

import threading

import pytest

from kernel.core.budget import Balance
from kernel.io.budgetorder import BudgetOrder

B = Balance(launches=1, sleeps=1, gpu_s=0)


def test_an_older_write_after_a_newer_one_is_skipped() -> None:
    order = BudgetOrder()
    old, new = order.stamp(), order.stamp()
    file: list[str] = []
    assert order.write("a", new, B, lambda b: file.append("new"))
    assert not order.write("a", old, B, lambda b: file.append("old"))
    assert file == ["new"]
    # Another workspace has its own order; a later read is written.
    assert order.write("b", old, B, lambda b: file.append("b old"))
    assert order.write("a", order.stamp(), B, lambda b: file.append("newer"))
    assert file == ["new", "b old", "newer"]


def test_a_write_that_failed_does_not_count() -> None:
    order = BudgetOrder()
    old, new = order.stamp(), order.stamp()

    def broken(b: Balance) -> None:
        raise OSError("disk")

    with pytest.raises(OSError, match="disk"):
        order.write("a", new, B, broken)
    file: list[str] = []
    assert order.write("a", old, B, lambda b: file.append("old"))
    assert file == ["old"]


def test_a_hung_write_holds_only_its_own_workspace() -> None:
    order = BudgetOrder()
    release = threading.Event()
    entered = threading.Event()

    def hung(b: Balance) -> None:
        entered.set()
        release.wait(10)

    t = threading.Thread(target=order.write, args=("a", order.stamp(), B, hung))
    t.start()
    assert entered.wait(5)
    done: list[str] = []
    assert order.write("b", order.stamp(), B, lambda b: done.append("b"))  # not held by a's hung write
    assert done == ["b"]
    release.set()
    t.join(5)


def test_shows_the_balance_of_the_last_write_that_ran() -> None:
    order = BudgetOrder()
    newer = Balance(launches=2, sleeps=1, gpu_s=0)
    assert not order.shows("a", B)  # nothing written yet
    old, new = order.stamp(), order.stamp()
    written: list[Balance] = []
    assert order.write("a", new, newer, written.append)
    assert not order.write("a", old, B, written.append)  # skipped: it does not count
    assert written == [newer]
    assert order.shows("a", newer)
    assert not order.shows("a", B)
