"""A store step uses sqlite only: it holds the store's lock, so a file it touched (a run directory on a shared
filesystem that hangs) would stall every workspace. The guard (kernel.io.stepguard, installed by tests/conftest.py
for every test) fails such a call; `tail` reads its run directory between two store steps, never in one."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import anyio
import pytest
from _parts import TOOL, enrolled

from channel.paths import RunPaths
from kernel.backends.local import LocalBackend
from kernel.core.config import Config, LiveConfig, parse
from kernel.io import stepguard
from kernel.io.enroll import Grant, enroll
from kernel.io.store import Store, StoreWorker
from kernel.service.execute import RealExecutor
from kernel.service.executor import PendingExecutor
from kernel.service.pipeline import Pipeline


def put(ws: Path, rid: str, body: dict[str, object]) -> None:
    rq = ws / ".syscall" / "requests"
    (rq / f".{rid}.tmp").write_text(json.dumps({"protocol": 1, "id": rid, **body}))
    (rq / f".{rid}.tmp").rename(rq / f"{rid}.json")


def answer(ws: Path, rid: str) -> dict[str, object]:
    got: dict[str, object] = json.loads((ws / ".syscall" / "answers" / f"{rid}.json").read_text())
    return got


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.read_bytes(),
        lambda p: os.open(p, os.O_RDONLY),
        lambda p: p.exists(),
        lambda p: os.stat(p),
        lambda p: os.listdir(p.parent),
        lambda p: list(os.scandir(p.parent)),
        lambda p: p.rename(p.with_name("moved")),
    ],
    ids=["read_bytes", "os.open", "exists", "os.stat", "listdir", "scandir", "rename"],
)
def test_a_filesystem_call_in_a_store_step_fails_and_is_recorded(
    tmp_path: Path, store: Store, call: object
) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    worker = StoreWorker(store)
    assert callable(call)
    call(f)  # outside a step the same call works
    if not f.exists():
        f.write_bytes(b"x")
    assert stepguard.found() == []

    def step() -> object:
        store.counts()  # sqlite is what a step is for
        return call(f)

    with pytest.raises(stepguard.FileCallInStoreStep, match="in a store step"):
        worker.run_here(step)
    found = stepguard.found()
    stepguard.clear()  # this test's own violation, not one of the code under test
    assert len(found) == 1, found
    assert f.read_bytes() == b"x"  # refused before it was made


def test_a_store_step_that_only_uses_sqlite_passes(store: Store) -> None:
    worker = StoreWorker(store)
    assert worker.run_here(store.counts)["workspaces"] == 0
    assert anyio.run(worker.call, store.workspaces) == []
    assert stepguard.found() == []


def test_closing_the_store_waits_for_a_step_running_on_another_thread(store: Store) -> None:
    """At stop, a channel I/O thread whose caller was cancelled may still run a store step while the service
    closes the store: closing under it freed the connection under that step (the kernel died of SIGSEGV)."""
    worker = StoreWorker(store)
    inside = threading.Event()
    results: list[object] = []

    def step() -> int:
        inside.set()
        time.sleep(0.3)  # the close is called meanwhile
        return int(store.counts()["workspaces"])

    def run() -> None:
        try:
            results.append(worker.run_here(step))
        except Exception as exc:  # the test reports what the step met
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(5)
    store.close()
    thread.join(5)
    assert results == [0], results  # the step finished on an open connection
    with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
        worker.run_here(store.counts)  # a step after the close gets a clean error


def test_tail_reads_the_run_directory_outside_the_store_step(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    """A tail of a task that started: its log and its `started` file are read between two store steps (the
    guard would fail a read in one), and the requests after it in the same turn are answered in order."""
    ws, row = enrolled(tmp_path, store, cfg, Grant(launches=5, sleeps=5, gpu_hours=1))
    worker = StoreWorker(store)
    pipeline = Pipeline(LiveConfig(cfg), worker, PendingExecutor(worker))
    pipeline.set_workspaces([row])
    put(ws, "s1", {"type": "sleep", "launches": [{"name": "a", "command": "true", "minutes": 1}]})
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    assert answer(ws, "s1")["type"] == "accepted"

    run = tmp_path / "runs" / "a" / "0"
    run.mkdir(parents=True)
    (run / RunPaths.STDOUT).write_text("".join(f"line {i}\n" for i in range(10)))
    (run / RunPaths.STARTED).write_text("2026-01-01T00:00:00Z\n")
    with store.transaction():
        store.place_job(row.key, 1, "a", 0, backend="local", job_id="77", run_dir=str(run), at="t")

    put(ws, "t1", {"type": "tail", "launch": "a", "lines": 3})
    put(ws, "t2", {"type": "tail", "launch": "nope"})
    put(ws, "t3", {"type": "tail", "launch": "a", "stderr": True})
    put(ws, "t4", {"type": "status"})
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    assert stepguard.found() == []

    t1 = answer(ws, "t1")
    assert (t1["type"], t1["text"], t1["lines"]) == ("tail", "line 7\nline 8\nline 9\n", 3)
    assert (t1["state"], t1["job_id"], t1["stream"]) == ("RUNNING", "77", "stdout")  # its `started` is there
    t2 = answer(ws, "t2")
    assert (t2["type"], t2["error"]["code"]) == ("rejected", "tail.unknown_task")  # type: ignore[index]
    t3 = answer(ws, "t3")
    assert (t3["type"], t3["text"], t3["size"]) == ("tail", "", 0)  # no stderr yet
    assert answer(ws, "t4")["type"] == "status"
    assert pipeline.answered == 5
    # Recorded: the same request again gets the stored answer, the directory is not read again.
    (run / RunPaths.STDOUT).write_text("changed\n")
    before = (ws / ".syscall" / "answers" / "t1.json").read_bytes()
    put(ws, "t1", {"type": "tail", "launch": "a", "lines": 3})
    pipeline.mark(row.key)
    anyio.run(pipeline.run_pass)
    assert (ws / ".syscall" / "answers" / "t1.json").read_bytes() == before
    assert [j.state for j in store.jobs_of(row.key, 1)] == ["PENDING"]  # a tail records nothing of the task


def _committed_workspace(path: Path) -> Path:
    path.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    (path / "train.py").write_text("print('hi')\n")
    for argv in (["init", "-q"], ["add", "train.py"], ["commit", "-qm", "one"]):
        subprocess.run(["git", "-C", str(path), *argv], check=True, env=env)
    return path


def test_a_sleep_runs_to_its_wake_with_no_file_call_in_a_store_step(tmp_path: Path) -> None:
    """The real executor and the local backend, in-process: the start's recovery, the dispatch, the tracking of
    the task's start and end, the gather and the wake. Their run-directory reads (exit records, `started`, the
    end's hint) go before or after the store steps that record them."""
    text = f'state_dir = "{tmp_path}/state"\nbackend = "local"\njail = "none"\n[environment]\nmode = "none"\n'
    cfg = parse(text, "<test>", env={})
    Path(cfg.state_dir).mkdir(parents=True)
    store = Store.open(cfg.paths.store)
    ws = _committed_workspace(tmp_path / "ws")
    row = enroll(store, cfg, str(ws), TOOL, Grant(launches=5, sleeps=5, gpu_hours=1)).row
    live = LiveConfig(cfg)
    executor = RealExecutor(live, StoreWorker(store), LocalBackend())
    pipeline = Pipeline(live, executor.worker, executor)
    pipeline.set_workspaces([row])
    wakes = ws / ".syscall" / "wakes"
    command = "echo hi; echo oops >&2; exit 3"
    put(ws, "s1", {"type": "sleep", "launches": [{"name": "a", "command": command, "minutes": 1}]})

    async def main() -> None:
        await executor.recover()
        async with anyio.create_task_group() as tg:
            tg.start_soon(executor.run)
            with anyio.fail_after(60):
                while not list(wakes.glob("*.json")):
                    pipeline.mark(row.key)
                    await pipeline.run_pass()
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        store.close()
    assert stepguard.found() == []
    (wake_file,) = wakes.glob("*.json")
    (task,) = json.loads(wake_file.read_text())["tasks"]
    assert (task["state"], task["exit_code"], task["stdout_tail"]) == ("FAILED", 3, "hi\n")
    assert task["hint"] is not None  # the end's hint, read from the run directory before the gather's step
