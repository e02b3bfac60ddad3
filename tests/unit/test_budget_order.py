"""kernel.io.budgetorder: budget.json writes in the order of their balances' reads, per workspace."""

from __future__ import annotations

import threading

import pytest

from kernel.io.budgetorder import BudgetOrder


def test_an_older_write_after_a_newer_one_is_skipped() -> None:
    order = BudgetOrder()
    old, new = order.stamp(), order.stamp()
    file: list[str] = []
    assert order.write("a", new, lambda: file.append("new"))
    assert not order.write("a", old, lambda: file.append("old"))
    assert file == ["new"]
    # Another workspace has its own order; a later read is written.
    assert order.write("b", old, lambda: file.append("b old"))
    assert order.write("a", order.stamp(), lambda: file.append("newer"))
    assert file == ["new", "b old", "newer"]


def test_a_write_that_failed_does_not_count() -> None:
    order = BudgetOrder()
    old, new = order.stamp(), order.stamp()

    def broken() -> None:
        raise OSError("disk")

    with pytest.raises(OSError, match="disk"):
        order.write("a", new, broken)
    file: list[str] = []
    assert order.write("a", old, lambda: file.append("old"))
    assert file == ["old"]


def test_a_hung_write_holds_only_its_own_workspace() -> None:
    order = BudgetOrder()
    release = threading.Event()
    entered = threading.Event()

    def hung() -> None:
        entered.set()
        release.wait(10)

    t = threading.Thread(target=order.write, args=("a", order.stamp(), hung))
    t.start()
    assert entered.wait(5)
    done: list[str] = []
    assert order.write("b", order.stamp(), lambda: done.append("b"))  # not held by a's hung write
    assert done == ["b"]
    release.set()
    t.join(5)
