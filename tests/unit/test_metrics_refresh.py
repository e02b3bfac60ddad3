"""The state gauges from the store: what `metrics.refresh` sets, read back from the kernel's registry."""

from __future__ import annotations

from pathlib import Path

from _parts import enrolled

from kernel.core.budget import Balance
from kernel.core.config import Config
from kernel.io import metrics
from kernel.io.store import AdminRow, Store


def budget(key: str, kind: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(f"{metrics.P}budget_left", {"workspace": key, "kind": kind})


def test_refresh_sets_each_workspaces_budget_and_drops_an_unenrolled_ones(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    _, a = enrolled(tmp_path / "a", store, cfg)
    _, b = enrolled(tmp_path / "b", store, cfg)
    with store.transaction():
        store.set_balance(a.key, Balance(launches=7, sleeps=3, gpu_s=5400))
        store.set_problem(b.key, "its channel hung")
    metrics.refresh(store, degraded=False)
    assert (budget(a.key, "launches"), budget(a.key, "sleeps"), budget(a.key, "gpu_hours")) == (7, 3, 1.5)
    assert budget(b.key, "launches") == b.balance.launches
    assert metrics.REGISTRY.get_sample_value(f"{metrics.P}channels_with_problems") == 1
    # The same as the rows say, read the light way.
    assert {k: bal for k, bal, _ in store.balances()} == {r.key: r.balance for r in store.workspaces()}

    with store.transaction():
        store.set_balance(a.key, Balance(launches=6, sleeps=3, gpu_s=5400))
        store.set_admin(b.key, AdminRow(unenrolled_at="2026-12-03T00:00:00.000Z"))
    metrics.refresh(store, degraded=True)
    assert budget(a.key, "launches") == 6  # changed: set again
    assert budget(a.key, "gpu_hours") == 1.5  # unchanged: kept
    assert budget(b.key, "launches") is None  # unenrolled: its gauges are gone
    assert metrics.REGISTRY.get_sample_value(f"{metrics.P}workspaces") == 1
    assert metrics.REGISTRY.get_sample_value(f"{metrics.P}degraded") == 1

    # Another process (the operator's `budget` command) changes a balance: seen at the next refresh.
    other = Store.open(store.path)
    try:
        with other.transaction():
            other.set_balance(a.key, Balance(launches=2, sleeps=3, gpu_s=5400))
    finally:
        other.close()
    metrics.refresh(store, degraded=False)
    assert budget(a.key, "launches") == 2
    assert metrics.REGISTRY.get_sample_value(f"{metrics.P}degraded") == 0
