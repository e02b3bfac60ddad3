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
from _parts import TOOL, ReadyNotifier

from kernel.core import serving as sv
from kernel.core.config import Config, LiveConfig, parse
from kernel.core.records import WorkspaceRow
from kernel.io import admin
from kernel.io.crash import HANG_ENV
from kernel.io.enroll import Grant, enroll
from kernel.io.store import Store
from kernel.service.loop import Service

OVERDUE = "channel I/O has not returned since"
CONFIG = "channel_io_deadline_seconds = 0.3\nrescan_seconds = 0.5\npoll_seconds = 0.1\n"


Handled = tuple[int, sv.Event, list[sv.Action]]


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


def setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str = CONFIG
) -> tuple[Config, Store, Path]:
    """The config, the store and the hang file (kernel.io.crash.hang_point) of a kernel run in process."""
    cfg = parse(f'state_dir = "{tmp_path}/state"\n{config}', "<test>", env={})
    hang = tmp_path / "hang"
    monkeypatch.setenv(HANG_ENV, str(hang))
    return cfg, Store.open(cfg.paths.store), hang


def serve_while(
    cfg: Config,
    store: Store,
    handled: list[Handled],
    body: Callable[[Service], Awaitable[None]],
    *,
    fed_back: bool = True,
) -> None:
    """Run a Service until `body(svc)`, started once it is ready, returns; then check that every change of its
    serving state was made on the event loop's thread (and, with `fed_back`, that a look's outcome was among
    them)."""
    notifier = ReadyNotifier()
    svc = Service(LiveConfig(cfg), store, notifier, TOOL)
    loop_thread: list[int] = []

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            with anyio.fail_after(10):
                await notifier.is_ready.wait()
            await body(svc)
            svc.stop("test")

    try:
        anyio.run(main)
    finally:
        store.close()
    off = [ev for thread, ev, _ in handled if thread != loop_thread[0]]
    assert not off, f"serving state changed off the event loop: {off[:5]}"
    assert any(isinstance(ev, sv.LookDone) for _, ev, _ in handled) or not fed_back, "no look was fed back"


async def _shows(read: Callable[[], Awaitable[str | None]], text: str) -> bool:
    return text in (await read() or "")


async def _clear(read: Callable[[], Awaitable[str | None]]) -> bool:
    return await read() is None


def test_a_hung_admission_holds_neither_ready_nor_another_workspace_and_is_served_once_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    """A's channel hangs in the start's admission: the start reaches `ready`, B is served, A's overdue I/O is
    its problem, and A is admitted and served (its waiting request answered) once the call returns."""
    cfg, store, hang = setup(tmp_path, monkeypatch)
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    row_a = enrolled(store, cfg, a)
    enrolled(store, cfg, b)
    put_status(a, "a1")  # waiting in A's channel from before the start
    hang.write_text(f"admit {row_a.path}")
    key = row_a.key

    async def body(svc: Service) -> None:
        assert svc.serving.phase(key) is sv.Phase.OVERDUE
        assert key not in svc.pipeline.workspaces
        await served_meanwhile(b)
        await until(lambda: _shows(problem(svc, key), OVERDUE), 5, "A's overdue admission is its problem")
        assert not answered(a, "a1"), "A's admission never returned, yet its request was answered"
        hang.unlink()  # the filesystem answers again
        await until(lambda: answered(a, "a1"), 5, "A served once its admission returned")
        await until(lambda: _clear(problem(svc, key)), 5, "A's problem cleared")
        assert svc.serving.phase(key) is sv.Phase.SERVED
        await served_meanwhile(b)

    serve_while(cfg, store, handled_on, body)


def test_a_hung_look_at_a_workspace_enrolled_meanwhile_holds_no_other_and_is_served_once_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    """Another process (the operator's `enroll`) enrolls A while the kernel serves B; the poll tick sees it and
    the kernel looks at A's channel in the look pool, where it hangs: B is served, A's overdue look is its
    problem, no second look at A starts while it hangs, and A is served once it returns."""
    cfg, store, hang = setup(tmp_path, monkeypatch)
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    enrolled(store, cfg, b)

    async def body(svc: Service) -> None:
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
            x for _, _, acts in handled_on for x in acts if isinstance(x, sv.Look) and x.row.key == key
        ]
        assert len(wanted) >= 2
        assert len(started) == 1
        assert not answered(a, "a1")
        hang.unlink()
        await until(lambda: answered(a, "a1"), 5, "A served once its look returned")
        await until(lambda: _clear(problem(svc, key)), 5, "A's problem cleared")
        await served_meanwhile(b)

    serve_while(cfg, store, handled_on, body)


def test_a_hung_re_watch_shows_its_problem_holds_no_other_workspace_and_the_channel_is_watched_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    """A's watch is lost (its requests/ moved away and back) and its channel hangs when it is opened to be
    watched again: B is served, A's overdue I/O is its problem (A stays served: only its watch waits), and once
    it returns A is watched again: a request is answered within a second, with no rescan (10 minutes away) and no
    poll to find it."""
    config = CONFIG.replace("rescan_seconds = 0.5", "rescan_seconds = 600")
    cfg, store, hang = setup(tmp_path, monkeypatch, config)
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    key = enrolled(store, cfg, a).key
    enrolled(store, cfg, b)
    requests, away = a / ".syscall" / "requests", a / ".syscall" / "requests.away"

    async def body(svc: Service) -> None:
        await served_meanwhile(a, 1)
        hang.write_text(f"watch {a.resolve()}")
        os.rename(requests, away)
        os.rename(away, requests)
        await until(lambda: _shows(problem(svc, key), OVERDUE), 5, "A's overdue re-watch is its problem")
        assert svc.serving.phase(key) is sv.Phase.SERVED
        await served_meanwhile(b)
        hang.unlink()
        await until(lambda: _clear(problem(svc, key)), 5, "A's problem cleared")
        put_status(a, "a1")
        await until(lambda: answered(a, "a1"), 3, "A watched again: answered with no rescan")
        await served_meanwhile(b)

    serve_while(cfg, store, handled_on, body, fed_back=False)


def test_a_hung_turn_shows_its_problem_once_holds_no_other_workspace_and_answers_once_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    """A's full listing of requests/ hangs (a huge or slow directory): B is served, A's problem says that
    nothing more is started for it (the request path's wording, built by the serve core); once the listing
    returns A's waiting request is answered and the problem clears."""
    cfg, store, hang = setup(tmp_path, monkeypatch)
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    key = enrolled(store, cfg, a).key
    enrolled(store, cfg, b)
    requests = a / ".syscall" / "requests"

    async def body(svc: Service) -> None:
        await served_meanwhile(a, 1)
        hang.write_text(f"listing {a.resolve()}")
        (requests / "junk").write_bytes(b"")  # a junk name asks for a full listing: it hangs
        await until(lambda: _shows(problem(svc, key), OVERDUE), 5, "A's overdue turn is its problem")
        put_status(a, "a1")  # waits for the listing
        shown = await problem(svc, key)()
        assert "nothing more is started for this workspace until it returns" in (shown or "")
        await served_meanwhile(b)
        assert not answered(a, "a1"), "A's listing never returned, yet its request was answered"
        hang.unlink()
        await until(lambda: answered(a, "a1"), 5, "A answered once its listing returned")
        await until(lambda: _clear(problem(svc, key)), 5, "A's problem cleared")
        await served_meanwhile(a, 1)

    serve_while(cfg, store, handled_on, body, fed_back=False)


def test_a_channel_that_hangs_in_the_after_ready_refresh_holds_no_other_workspace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    """After `ready` the kernel-written files of every admitted channel (stale: kernel.core.serving) are
    refreshed in the background. A's channel hangs there: B is served meanwhile, A's budget.json is not
    rewritten while it hangs, and is once the refresh returns; then A is served."""
    cfg, store, hang = setup(tmp_path, monkeypatch)
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    row_a = enrolled(store, cfg, a)
    enrolled(store, cfg, b)
    budget = a / ".syscall" / "budget.json"
    budget.write_text("damaged")  # rewritten by the refresh once A answers
    hang.write_text(f"refresh {row_a.path}")

    async def body(svc: Service) -> None:
        await until(lambda: _shows(problem(svc, row_a.key), OVERDUE), 5, "A's overdue refresh is its problem")
        await served_meanwhile(b)
        assert budget.read_text() == "damaged"
        hang.unlink()
        await until(lambda: budget.read_text() != "damaged", 5, "A's budget.json rewritten")
        assert json.loads(budget.read_text())["budget"]["launches"] > 0
        await served_meanwhile(a, 1)

    serve_while(cfg, store, handled_on, body)


# What runs off the event loop in the driver says so first in its docstring.
OFF_LOOP = ("(a store step)", "(store worker)", "(channel look pool)", "(channel I/O pool)")


def test_no_pool_call_or_store_step_of_the_driver_can_reach_the_serving_state() -> None:
    """The service's methods that run on a pool thread or the store worker, and every method of the service they
    call, never touch the serving state (`serving`, `_feed`): they return what they found, the loop feeds it."""
    import ast
    import inspect

    import kernel.service.loop as loop

    cls = next(
        n
        for n in ast.parse(inspect.getsource(loop)).body
        if isinstance(n, ast.ClassDef) and n.name == "Service"
    )
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}

    def uses(f: ast.AST) -> set[str]:
        return {
            n.attr
            for n in ast.walk(f)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        }

    off = [name for name, f in methods.items() if (ast.get_docstring(f) or "").startswith(OFF_LOOP)]
    assert {"_admit_from", "_admit_io", "_refresh_io", "_look_io", "_startup", "_read_changes"} <= set(off)
    for name in off:
        seen, todo = set(), [name]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            got = uses(methods[m])
            assert not got & {"serving", "_feed", "_act"}, (
                f"{name} (off the loop) reaches the serving state via {m}"
            )
            todo += [a for a in got if a in methods]


def test_a_workspace_another_process_unenrolls_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handled_on: list[Handled]
) -> None:
    """The operator unenrolls A (another process) while the kernel serves A and B, both polled: once the poll
    tick notices, nothing of A is left in the serving state, its poll schedule, the pipeline or the locks, and B
    is served as before."""
    cfg, store, _ = setup(tmp_path, monkeypatch, CONFIG + 'watch = "poll"\n')
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    key = enrolled(store, cfg, a).key
    enrolled(store, cfg, b)

    async def body(svc: Service) -> None:
        await served_meanwhile(a, 2)
        assert key in svc.serving.known()
        assert key in svc.polls
        other = Store.open(cfg.paths.store)  # the operator's `syscall-kernel unenroll`
        try:
            await anyio.to_thread.run_sync(lambda: admin.unenroll(other, str(a)))
        finally:
            other.close()
        await until(lambda: key not in svc.pipeline.workspaces, 5, "A no longer served")
        await served_meanwhile(b, 2)  # a few ticks and passes later
        assert key not in svc.serving.known()
        assert key not in svc.polls
        assert not svc.custody.holds(key)
        assert svc.serving.problem(key) is None
        pipeline = svc.pipeline
        kept = [pipeline.backlog, pipeline.dirty, pipeline.named, pipeline.busy, pipeline.inflight]
        assert not any(key in part for part in kept)

    serve_while(cfg, store, handled_on, body)
