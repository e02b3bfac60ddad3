"""The serve core's driver (kernel.service.loop) in process: a real store, real enrollment, real channels, real
pool threads and the test-only hang point (kernel.io.crash.hang_point) where a hung filesystem would block, with
a short `channel_io_deadline_seconds`, so a hang scenario takes a second, not a kernel process's start-up and
real deadlines. Every change of the serving state (kernel.core.serving) is checked to happen on the event loop's
thread: the pool threads and the store worker only hand their findings over."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from _parts import TOOL

from kernel.core import serving as sv
from kernel.core.config import Config, LiveConfig, parse
from kernel.core.records import WorkspaceRow
from kernel.io.crash import HANG_ENV
from kernel.io.enroll import Grant, enroll
from kernel.io.store import Store
from kernel.service.loop import Service
from kernel.service.notify import Notifier

OVERDUE = "channel I/O has not returned since"
CONFIG = "channel_io_deadline_seconds = 0.3\nrescan_seconds = 0.5\npoll_seconds = 0.1\n"


Handled = tuple[int, sv.Event, list[sv.Action]]


class ReadyNotifier(Notifier):
    def __init__(self) -> None:
        super().__init__(None, None)
        self.is_ready = anyio.Event()

    def ready(self, status: str) -> None:
        self.is_ready.set()


@pytest.fixture
def handled_on(monkeypatch: pytest.MonkeyPatch) -> list[Handled]:
    """Every event the serving state handles, with the thread that handed it over and the actions it gave."""
    seen: list[Handled] = []
    real = sv.Serving.handle

    def handle(self: sv.Serving, ev: sv.Event) -> list[sv.Action]:
        actions = real(self, ev)
        seen.append((threading.get_ident(), ev, actions))
        return actions

    monkeypatch.setattr(sv.Serving, "handle", handle)
    return seen


def workspace(tmp_path: Path, name: str) -> Path:
    ws = tmp_path / name
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    return ws


def enrolled(store: Store, cfg: Config, ws: Path) -> WorkspaceRow:
    return enroll(store, cfg, str(ws), TOOL, Grant()).row


def put_status(ws: Path, rid: str) -> None:
    req = ws / ".syscall" / "requests"
    (req / f".{rid}.tmp").write_text(json.dumps({"protocol": 1, "id": rid, "type": "status"}))
    os.rename(req / f".{rid}.tmp", req / f"{rid}.json")


def answered(ws: Path, rid: str) -> bool:
    return (ws / ".syscall" / "answers" / f"{rid}.json").exists()


async def until(what: Callable[[], bool | Awaitable[bool]], seconds: float, why: str) -> None:
    with anyio.fail_after(seconds):
        while True:
            got = what()
            if not isinstance(got, bool):
                got = await got
            if got:
                return
            await anyio.sleep(0.02)
    raise AssertionError(why)


async def served_meanwhile(ws: Path, n: int = 5) -> None:
    """`ws` is answered again and again, each within 2 s."""
    for i in range(n):
        rid = f"{ws.name}-{i}-{os.urandom(3).hex()}"
        put_status(ws, rid)
        await until(lambda rid=rid: answered(ws, rid), 2, f"{ws.name} answered")  # type: ignore[misc]


def problem(svc: Service, key: str) -> Callable[[], Awaitable[str | None]]:
    async def read() -> str | None:
        row = await svc.worker.call(svc.store.workspace, key)
        return None if row is None else row.problem

    return read


def on_the_loop(handled: list[Handled], loop_thread: int) -> None:
    off = [ev for thread, ev, _ in handled if thread != loop_thread]
    assert not off, f"serving state changed off the event loop: {off[:5]}"


def test_a_hung_admission_holds_neither_ready_nor_another_workspace_and_is_served_once_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    cfg = parse(f'state_dir = "{tmp_path}/state"\n{CONFIG}', "<test>", env={})
    store = Store.open(cfg.paths.store)
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    row_a, _ = enrolled(store, cfg, a), enrolled(store, cfg, b)
    put_status(a, "a1")  # waiting in A's channel from before the start
    hang = tmp_path / "hang"
    hang.write_text(f"admit {row_a.path}")
    monkeypatch.setenv(HANG_ENV, str(hang))
    notifier = ReadyNotifier()
    svc = Service(LiveConfig(cfg), store, notifier, TOOL)
    loop_thread: list[int] = []

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            with anyio.fail_after(10):
                await notifier.is_ready.wait()
            assert svc.serving.phase(row_a.key) is sv.Phase.OVERDUE
            assert row_a.key not in svc.pipeline.workspaces
            await served_meanwhile(b)
            await until(
                lambda: _shows(problem(svc, row_a.key), OVERDUE), 5, "A's overdue admission is its problem"
            )
            assert not answered(a, "a1"), "A's admission never returned, yet its request was answered"
            hang.unlink()  # the filesystem answers again
            await until(lambda: answered(a, "a1"), 5, "A served once its admission returned")
            await until(lambda: _clear(problem(svc, row_a.key)), 5, "A's problem cleared")
            assert svc.serving.phase(row_a.key) is sv.Phase.SERVED
            await served_meanwhile(b)
            svc.stop("test")

    try:
        anyio.run(main)
    finally:
        store.close()
    on_the_loop(handled_on, loop_thread[0])
    assert any(isinstance(ev, sv.LookDone) for _, ev, _ in handled_on)


def test_a_hung_look_at_a_workspace_enrolled_meanwhile_holds_no_other_and_is_served_once_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    """Another process (the operator's `enroll`) enrolls A while the kernel serves B; the poll tick sees it and
    the kernel looks at A's channel in the look pool, where it hangs."""
    cfg = parse(f'state_dir = "{tmp_path}/state"\n{CONFIG}', "<test>", env={})
    store = Store.open(cfg.paths.store)
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    enrolled(store, cfg, b)
    hang = tmp_path / "hang"
    monkeypatch.setenv(HANG_ENV, str(hang))
    notifier = ReadyNotifier()
    svc = Service(LiveConfig(cfg), store, notifier, TOOL)
    loop_thread: list[int] = []

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            with anyio.fail_after(10):
                await notifier.is_ready.wait()
            await served_meanwhile(b, 1)
            hang.write_text(f"look {a.resolve()}")
            other = Store.open(cfg.paths.store)  # another process's `enroll`
            try:
                key = (await anyio.to_thread.run_sync(enrolled, other, cfg, a)).key
            finally:
                other.close()
            await until(lambda: svc.serving.phase(key) is sv.Phase.OVERDUE, 5, "A's look overdue")
            put_status(a, "a1")
            await served_meanwhile(b)
            await until(lambda: _shows(problem(svc, key), OVERDUE), 5, "A's overdue look is its problem")
            # Every rescan asks for a look at A again (its lock is not held): none starts while one hangs.
            await anyio.sleep(1.2)
            wanted = [ev for _, ev, _ in handled_on if isinstance(ev, sv.LookWanted) and ev.row.key == key]
            started = [
                a for _, _, acts in handled_on for a in acts if isinstance(a, sv.Look) and a.row.key == key
            ]
            assert len(wanted) >= 2
            assert len(started) == 1
            assert not answered(a, "a1")
            hang.unlink()
            await until(lambda: answered(a, "a1"), 5, "A served once its look returned")
            await until(lambda: _clear(problem(svc, key)), 5, "A's problem cleared")
            await served_meanwhile(b)
            svc.stop("test")

    try:
        anyio.run(main)
    finally:
        store.close()
    on_the_loop(handled_on, loop_thread[0])


async def _shows(read: Callable[[], Awaitable[str | None]], text: str) -> bool:
    return text in (await read() or "")


async def _clear(read: Callable[[], Awaitable[str | None]]) -> bool:
    return await read() is None
