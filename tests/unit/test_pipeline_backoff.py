"""A dispatch that fails for the world's reasons (ExecutorUnavailable) is retried with a per-workspace,
exponential, capped backoff, logged once per state change; other workspaces and the same workspace's read-only
requests are served meanwhile. Real store, real enrollment, real directories; the clock is the test's."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import anyio
import pytest
from _parts import Clock, enrolled

from kernel.core import rules
from kernel.core.config import Config, LiveConfig
from kernel.io.enroll import Grant
from kernel.io.store import Store, StoreWorker
from kernel.service.executor import ExecutorUnavailable, JobRef, PendingExecutor, SleepOrder
from kernel.service.pipeline import RETRY_BASE_S, RETRY_CAP_S, Pipeline, PipelineHooks


class Failing(PendingExecutor):
    """An executor that cannot dispatch (fork failing at the process limit) until `healthy` is set."""

    def __init__(self, worker: StoreWorker, clock: Clock) -> None:
        super().__init__(worker)
        self.clock = clock
        self.at: list[float] = []
        self.healthy = False

    @property
    def calls(self) -> int:
        return len(self.at)

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        self.at.append(self.clock.now)
        if not self.healthy:
            raise ExecutorUnavailable("fork: Resource temporarily unavailable")
        return await super().dispatch(order)


def put(ws: Path, rid: str, body: dict[str, object]) -> Path:
    rq = ws / ".syscall" / "requests"
    (rq / f".{rid}.tmp").write_text(json.dumps({"protocol": 1, "id": rid, **body}))
    (rq / f".{rid}.tmp").rename(rq / f"{rid}.json")
    return rq / f"{rid}.json"


def test_retry_delay_doubles_and_is_capped() -> None:
    assert [rules.retry_delay(n, 1.0, 60.0) for n in range(9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert rules.retry_delay(10_000, 1.0, 60.0) == 60.0


def test_executor_unavailable_backs_off_per_workspace_and_logs_once(
    tmp_path: Path, cfg: Config, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    ws, row = enrolled(tmp_path, store, cfg, Grant(launches=5, sleeps=5, gpu_hours=1))
    clock = Clock()
    worker = StoreWorker(store)
    executor = Failing(worker, clock)
    pipeline = Pipeline(LiveConfig(cfg), worker, executor, clock=clock, hooks=PipelineHooks(plan_clock=clock))
    pipeline.set_workspaces([row])
    put(ws, "s1", {"type": "sleep", "launches": [{"name": "a", "command": "true", "minutes": 1}]})

    def serve_for(seconds: float, step: float = 0.01) -> None:
        """What the service loop does: pass after pass (a storm would call the executor at every one)."""
        end = clock.now + seconds
        while clock.now < end:
            pipeline.due_retries()
            pipeline.mark(row.key)  # as if events kept coming
            anyio.run(pipeline.run_pass)
            clock.now += step

    caplog.set_level(logging.INFO)
    serve_for(10.0)
    # 1 s, 2 s, 4 s after the first failure: 4 calls in 10 s, not one per pass (1,000)
    assert executor.calls == 4
    assert caplog.text.count("event=executor_unavailable") == 1
    assert pipeline.due_retries() is not None  # the service sleeps until then

    put(ws, "q1", {"type": "status"})  # read-only requests are answered meanwhile
    serve_for(0.05)
    assert (ws / ".syscall" / "answers" / "q1.json").exists()
    assert not (ws / ".syscall" / "answers" / "s1.json").exists()

    serve_for(RETRY_CAP_S * 3, step=0.5)
    gaps = [round(b - a) for a, b in itertools.pairwise(executor.at)]
    doubling = [RETRY_BASE_S * 2**i for i in range(len(gaps))]
    assert gaps == [min(RETRY_CAP_S, d) for d in doubling], gaps  # exponential, then capped
    assert gaps[-1] == RETRY_CAP_S

    executor.healthy = True
    serve_for(RETRY_CAP_S + 1, step=0.5)
    answer = json.loads((ws / ".syscall" / "answers" / "s1.json").read_text())
    assert answer["type"] == "accepted"
    assert "event=executor_available" in caplog.text
    assert pipeline.due_retries() is None


def test_the_retry_time_is_on_the_services_clock_not_the_wall_clock(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    """The service compares `due_retries` with its other wake-up times (monotonic): a wall-clock time there
    (1.7e9 against an uptime) was never the earliest, so a retry waited for the next tick instead."""
    ws, row = enrolled(tmp_path, store, cfg, Grant(launches=5, sleeps=5, gpu_hours=1))
    wall, service = Clock(), Clock()
    service.now = 100.0
    worker = StoreWorker(store)
    pipeline = Pipeline(
        LiveConfig(cfg), worker, Failing(worker, wall), clock=wall, hooks=PipelineHooks(plan_clock=service)
    )
    pipeline.set_workspaces([row])
    put(ws, "s1", {"type": "sleep", "launches": [{"name": "a", "command": "true", "minutes": 1}]})
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    retry_at = pipeline.due_retries()
    assert retry_at is not None
    assert service.now < retry_at <= service.now + RETRY_CAP_S
