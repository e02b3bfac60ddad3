"""The executor seam under faults, with the real pipeline, store and channel in-process.

An executor that is unavailable leaves the sleep recorded but unanswered until a later rescan resumes it; one
that refuses (the agent's fault, e.g. an unusable repository) gets the sleep rejected and the charge refunded
exactly. These executors are fakes of the execution layer, which does not exist in this issue.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from channel.decode import RequestError
from channel.messages import JobRef
from kernel.core.config import LiveConfig, parse
from kernel.io.enroll import Grant, enroll
from kernel.io.install import ToolSource
from kernel.io.store import Store, StoreWorker
from kernel.service.executor import DispatchRefused, ExecutorUnavailable, PendingExecutor, SleepOrder
from kernel.service.loop import Service
from kernel.service.notify import Notifier

SLEEP = {
    "protocol": 1,
    "id": "z1",
    "type": "sleep",
    "launches": [{"name": "a", "command": "true", "gpus": 1, "minutes": 30, "array": 2}],
}


class Flaky(PendingExecutor):
    def __init__(self, worker: StoreWorker) -> None:
        super().__init__(worker)
        self.calls = 0

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        self.calls += 1
        if self.calls == 1:
            raise ExecutorUnavailable("scheduler not answering")
        return tuple(JobRef(launch=j.launch, task=j.task, job_id=f"9{j.task}") for j in order.jobs)


class Refusing(PendingExecutor):
    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        raise DispatchRefused(RequestError("snapshot.failed", "the repository has no commits"))


async def wait_file(path: Path, deadline_s: float) -> bytes:
    """Wait (with a deadline) for a file the service writes; checked off the event loop."""
    with anyio.fail_after(deadline_s):
        while not await anyio.to_thread.run_sync(path.exists):  # noqa: ASYNC110 - a file, not an event
            await anyio.sleep(0.01)
    return await anyio.to_thread.run_sync(path.read_bytes)


def run_service(tmp_path: Path, executor: type[PendingExecutor]) -> tuple[dict[str, object], Store, Service]:
    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    cfg = parse(f'state_dir = "{tmp_path}/state"\nrescan_seconds = 0.3\n', "<test>", env={})
    store = Store.open(cfg.paths.store)
    enroll(store, cfg, str(ws), ToolSource(b"tool"), Grant(launches=3, sleeps=2, gpu_hours=2))
    svc = Service(LiveConfig(cfg), store, Notifier(None, None), ToolSource(b"tool"), executor)
    req = ws / ".syscall" / "requests"

    async def main() -> dict[str, object]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            (req / ".z1.tmp").write_text(json.dumps(SLEEP))
            (req / ".z1.tmp").rename(req / "z1.json")
            answer = await wait_file(ws / ".syscall" / "answers" / "z1.json", 10)
            svc.stop("test")
        return json.loads(answer)  # type: ignore[no-any-return]

    return anyio.run(main), store, svc


def test_unavailable_executor_leaves_the_sleep_unanswered_until_a_rescan(tmp_path: Path) -> None:
    answer, store, svc = run_service(tmp_path, Flaky)
    assert isinstance(svc.executor, Flaky)
    assert svc.executor.calls == 2
    assert answer["type"] == "accepted"
    assert [j["job_id"] for j in answer["jobs"]] == ["90", "91"]  # type: ignore[index]
    assert answer["budget"] == {"launches": 2, "sleeps": 1, "gpu_hours": 1.0, "reserved_gpu_hours": 1.0}
    assert store.unanswered() == []
    store.close()


def test_refused_dispatch_rejects_and_refunds_exactly(tmp_path: Path) -> None:
    answer, store, _ = run_service(tmp_path, Refusing)
    assert answer["type"] == "rejected"
    assert answer["error"]["code"] == "snapshot.failed"  # type: ignore[index]
    (ws,) = store.workspaces()
    assert (ws.balance.launches, ws.balance.sleeps, ws.balance.gpu_s, ws.balance.reserved_gpu_s) == (
        3,
        2,
        7200,
        0,
    )
    sleep = store.sleep(ws.key, 1)
    assert sleep is not None
    assert sleep.state == "rejected"
    assert {j.state for j in store.jobs_of(ws.key, 1)} == {"CANCELLED"}
    assert store.current_sleep(ws.key) is None
    store.close()


@pytest.mark.parametrize("executor", [PendingExecutor])
def test_pending_executor_accepts_without_job_ids(tmp_path: Path, executor: type[PendingExecutor]) -> None:
    answer, store, _ = run_service(tmp_path, executor)
    assert [j["job_id"] for j in answer["jobs"]] == [None, None]  # type: ignore[index]
    (ws,) = store.workspaces()
    assert [j.state for j in store.jobs_of(ws.key, 1)] == ["PENDING", "PENDING"]
    store.close()


class Gated(PendingExecutor):
    """Holds every dispatch until the test opens the gate."""

    def __init__(self, worker: StoreWorker) -> None:
        super().__init__(worker)
        self.entered = anyio.Event()
        self.gate = anyio.Event()

    async def dispatch(self, order: SleepOrder) -> tuple[JobRef, ...]:
        self.entered.set()
        await self.gate.wait()
        return await super().dispatch(order)


def test_a_slow_dispatch_holds_only_its_own_workspace_and_is_drained_at_stop(tmp_path: Path) -> None:
    cfg = parse(f'state_dir = "{tmp_path}/state"\n', "<test>", env={})
    store = Store.open(cfg.paths.store)
    spaces = []
    for name in ("a", "b"):
        ws = tmp_path / name
        ws.mkdir()
        subprocess.run(["git", "init", "-q", str(ws)], check=True)
        enroll(store, cfg, str(ws), ToolSource(b"tool"))
        spaces.append(ws)
    a, b = spaces
    svc = Service(LiveConfig(cfg), store, Notifier(None, None), ToolSource(b"tool"), Gated)
    gated = svc.executor
    assert isinstance(gated, Gated)

    def put(ws: Path, rid: str, body: dict[str, object]) -> None:
        req = ws / ".syscall" / "requests"
        (req / f".{rid}.tmp").write_text(json.dumps({"protocol": 1, "id": rid, **body}))
        (req / f".{rid}.tmp").rename(req / f"{rid}.json")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            put(a, "z1", {"type": "sleep", "launches": [{"name": "t", "command": "true"}]})
            with anyio.fail_after(10):
                await gated.entered.wait()
            put(a, "a2", {"type": "status"})
            put(b, "b1", {"type": "status"})
            await wait_file(b / ".syscall" / "answers" / "b1.json", 10)
            # A's status waits behind A's sleep, which is still at the executor.
            assert not (a / ".syscall" / "answers" / "a2.json").exists()
            assert not (a / ".syscall" / "answers" / "z1.json").exists()
            svc.stop("test")
            gated.gate.set()
        # The stop drained the dispatch in flight: its answer was written before the service returned.
        answer = json.loads((a / ".syscall" / "answers" / "z1.json").read_bytes())
        assert answer["type"] == "accepted"

    anyio.run(main)
    assert (a / ".syscall" / "requests" / "a2.json").exists(), "an unhandled request stays for the next start"
    store.close()
