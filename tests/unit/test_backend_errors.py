"""Backends name whose fault a failure is with a type (kernel.backends.base): `BackendRefused` is the agent's (the
sleep is rejected `backend.refused` and refunded), `BackendUnavailable` the world's (the sleep waits, retried with
the per-workspace backoff). The executor decides by those types, never by a class's name.

Real store, real enrollment, real git snapshot, the real executor and the real backends (the local one, and the
Slurm one against the fake Slurm clients); the pipeline's clock is the test's.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
from pathlib import Path

import anyio
import pytest
from _parts import TOOL, Clock
from fakes.fake_slurm import FakeSlurm

from channel.paths import RunPaths
from kernel.backends.base import BackendError, BackendRefused, BackendUnavailable, RunnableBackend
from kernel.backends.local import LocalBackend
from kernel.backends.slurm.backend import SlurmBackend, SlurmRefused, SlurmSubmitError
from kernel.core.config import Config, LiveConfig, parse
from kernel.core.records import WorkspaceRow
from kernel.io.enroll import Grant, enroll
from kernel.io.store import Store, StoreWorker
from kernel.service.execute import RealExecutor
from kernel.service.pipeline import Pipeline, PipelineHooks

ROOT = Path(__file__).resolve().parents[2]
REFUSED = "sbatch: error: Batch job submission failed: Invalid partition name specified"
TRANSIENT = "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"


# --- no decision by a class's name ---------------------------------------------------------------------------


def _name_tests(path: Path) -> list[str]:
    """Comparisons (and `in` tests) that read `__name__`, `__qualname__` or `__mro__`: deciding by a name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        reads = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        if reads & {"__name__", "__qualname__", "__mro__"}:
            bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    for node in ast.walk(
        tree
    ):  # any(c.__name__ == ... for c in type(e).__mro__) is a Compare too; mro alone:
        if isinstance(node, ast.Attribute) and node.attr == "__mro__":
            bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(set(bad))


@pytest.mark.parametrize("path", sorted((ROOT / "kernel").rglob("*.py")), ids=lambda p: p.name)
def test_no_kernel_module_decides_by_a_class_name(path: Path) -> None:
    bad = _name_tests(path)
    assert not bad, f"{bad}: catch the typed error (kernel.backends.base.BackendError) instead"


def test_the_name_check_sees_the_old_tests(tmp_path: Path) -> None:
    old = tmp_path / "old.py"
    old.write_text(
        "def worlds(e):\n    return isinstance(e, OSError) or type(e).__name__ == 'SlurmSubmitError'\n"
        "def refused(e):\n    return any(c.__name__ == 'SlurmRefused' for c in type(e).__mro__)\n"
        "def fine(e):\n    return f'{type(e).__name__}: {e}'\n"
    )
    found = _name_tests(old)
    assert len(found) == 3, found  # two comparisons and the __mro__ walk; the log line is fine


def test_the_slurm_errors_say_whose_fault_they_are() -> None:
    assert issubclass(SlurmRefused, BackendRefused)
    assert issubclass(SlurmSubmitError, BackendUnavailable)
    assert not issubclass(SlurmRefused, BackendUnavailable)
    assert not issubclass(BackendRefused, BackendUnavailable)
    assert issubclass(BackendUnavailable, BackendError)
    assert SlurmRefused("sk-x", "no such partition").detail == "no such partition"


# --- behaviour through the real executor ---------------------------------------------------------------------


def _cfg(tmp: Path, backend: str) -> Config:
    text = f'state_dir = "{tmp}/state"\nbackend = "{backend}"\njail = "none"\n[environment]\nmode = "none"\n'
    return parse(text, "<test>", env={})


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    (ws / "train.py").write_text("print('hi')\n")
    for argv in (["init", "-q"], ["add", "train.py"], ["commit", "-qm", "one"]):
        subprocess.run(["git", "-C", str(ws), *argv], check=True, env=env)
    return ws


@pytest.fixture
def fake(tmp_path: Path) -> FakeSlurm:
    return FakeSlurm(tmp_path / "fake")


def _put_sleep(ws: Path, rid: str) -> None:
    rq = ws / ".syscall" / "requests"
    body = {
        "protocol": 1,
        "id": rid,
        "type": "sleep",
        "launches": [{"name": "a", "command": "true", "minutes": 1}],
    }
    (rq / f".{rid}.tmp").write_text(json.dumps(body))
    (rq / f".{rid}.tmp").rename(rq / f"{rid}.json")


def _answer(ws: Path, rid: str) -> dict[str, object] | None:
    path = ws / ".syscall" / "answers" / f"{rid}.json"
    return json.loads(path.read_text()) if path.exists() else None


class World:
    """The pipeline and the real executor on one enrolled workspace, passes driven by the test's clock."""

    def __init__(self, cfg: Config, store: Store, ws: Path, backend: RunnableBackend) -> None:
        self.clock = Clock()
        self.row: WorkspaceRow = enroll(
            store, cfg, str(ws), TOOL, Grant(launches=5, sleeps=5, gpu_hours=1)
        ).row
        self.store = store
        self.ws = ws
        self.executor = RealExecutor(LiveConfig(cfg), StoreWorker(store), backend)
        self.pipeline = Pipeline(
            LiveConfig(cfg),
            self.executor.worker,
            self.executor,
            clock=self.clock,
            hooks=PipelineHooks(plan_clock=self.clock),
        )
        self.pipeline.set_workspaces([self.row])

    def balance(self) -> object:
        row = self.store.workspace(self.row.key)
        assert row is not None
        return row.balance

    async def serve_for(self, seconds: float, step: float = 0.05) -> None:
        """What the service loop does: pass after pass (a retry storm would dispatch at every one)."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.pipeline.due_retries()
            self.pipeline.mark(self.row.key)
            await self.pipeline.run_pass()
            self.clock.now += step


def _store(cfg: Config) -> Store:
    Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
    return Store.open(cfg.paths.store)


def _slurm(cfg: Config, fake: FakeSlurm, attempts: int) -> SlurmBackend:
    async def no_wait(_s: float) -> None:
        return None

    return SlurmBackend.from_config(
        cfg.slurm, env=fake.env(), sleep=no_wait, submit_attempts=attempts, exit_grace_s=0.0
    )


def test_a_sleep_slurm_refuses_is_rejected_and_refunded(tmp_path: Path, ws: Path, fake: FakeSlurm) -> None:
    cfg = _cfg(tmp_path, "slurm")
    store = _store(cfg)

    async def main() -> None:
        backend = _slurm(cfg, fake, attempts=3)
        w = World(cfg, store, ws, backend)
        before = w.balance()
        fake.fail_next("sbatch", 1, stderr=REFUSED)
        _put_sleep(ws, "s1")
        await w.serve_for(0.2)
        answer = _answer(ws, "s1")
        assert answer is not None
        assert answer["type"] == "rejected", answer
        error = answer["error"]
        assert isinstance(error, dict)
        assert error["code"] == "backend.refused"
        assert "Invalid partition name" in error["message"], error
        assert w.balance() == before  # refunded exactly
        assert fake.calls()["sbatch"] == 1  # answered, never retried
        assert fake.state()["jobs"] == {}
        backend.close()

    try:
        anyio.run(main)
    finally:
        store.close()


def test_slurm_unreachable_backs_off_then_the_sleep_is_accepted_once(
    tmp_path: Path, ws: Path, fake: FakeSlurm, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, "slurm")
    store = _store(cfg)
    caplog.set_level(logging.INFO)

    async def main() -> None:
        backend = _slurm(cfg, fake, attempts=1)
        w = World(cfg, store, ws, backend)
        for _ in range(4):
            fake.fail_next("sbatch", 1, stderr=TRANSIENT)
        _put_sleep(ws, "s1")
        await w.serve_for(10.0)
        # retried 1 s, 2 s and 4 s after the first failure: 4 submissions in 10 s, not one per pass (200)
        assert fake.calls()["sbatch"] == 4
        assert _answer(ws, "s1") is None
        assert caplog.text.count("event=executor_unavailable") == 1
        await w.serve_for(10.0)
        answer = _answer(ws, "s1")
        assert answer is not None
        assert answer["type"] == "accepted", answer
        jobs = answer["jobs"]
        assert isinstance(jobs, list)
        assert [j["job_id"] for j in jobs] == list(fake.state()["jobs"])  # one job, the one recorded
        assert "event=executor_available" in caplog.text
        backend.close()

    try:
        anyio.run(main)
    finally:
        store.close()


def test_a_local_backend_that_cannot_write_its_run_directory_backs_off(
    tmp_path: Path, ws: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, "local")
    store = _store(cfg)
    caplog.set_level(logging.INFO)

    async def main() -> None:
        backend = LocalBackend()
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)  # as the service runs it (its exit streams close when it stops)
            await scenario(backend)
            tg.cancel_scope.cancel()

    async def scenario(backend: LocalBackend) -> None:
        w = World(cfg, store, ws, backend)
        before = w.balance()
        # A real OSError inside LocalBackend.submit: its spec file's temp name is taken by a directory.
        launch_dir = RunPaths(Path(cfg.run_dir), w.row.key, 1, "a").launch_dir
        blocker = launch_dir / f".local.json.{os.getpid()}.tmp"
        blocker.mkdir(parents=True)
        _put_sleep(ws, "s1")
        await w.serve_for(10.0)
        assert _answer(ws, "s1") is None  # the world's fault: not answered, not refunded, waiting
        assert caplog.text.count("event=executor_unavailable") == 1
        assert "Is a directory" in caplog.text
        assert w.balance() != before  # still charged: the sleep stands
        blocker.rmdir()
        await w.serve_for(10.0)
        answer = _answer(ws, "s1")
        assert answer is not None
        assert answer["type"] == "accepted", answer
        assert (launch_dir / "local.json").is_file()

    try:
        anyio.run(main)
    finally:
        store.close()
