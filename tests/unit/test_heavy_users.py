"""Issue 13: the executor's work on one workspace's files (its repository in the kernel, its `.git`) goes through
that workspace's heavy pool: nothing more starts for a workspace whose heavy job has not returned (a hung
filesystem), that work has the pool's deadline, and other workspaces go on. Real store, real enrollment, the real
executor and evaluation; a hung heavy job of the workspace stands in for its hung filesystem.

On the old kernel the snapshot's release and the look for an older kernel's refs ran on plain threads: beside a
hung job of the same workspace, with no deadline and never shown in `status`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
from _parts import enrolled

from kernel.backends.local import LocalBackend
from kernel.core.config import Config, LiveConfig, parse
from kernel.io import repo as R
from kernel.io.store import Store, StoreWorker
from kernel.service.execute import RealExecutor
from kernel.service.heavy import HeavyPool
from kernel.service.submitexec import SubmitEvaluation


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    text = f'state_dir = "{tmp_path}/state"\nbackend = "local"\njail = "none"\n[environment]\nmode = "none"\n'
    return parse(text, "<test>", env={})


@pytest.fixture
def world(tmp_path: Path, cfg: Config, store: Store) -> tuple[Config, Store, str, str]:
    """Two enrolled workspaces, A and B."""
    return (
        cfg,
        store,
        enrolled(tmp_path / "a", store, cfg)[1].key,
        enrolled(tmp_path / "b", store, cfg)[1].key,
    )


def test_a_snapshot_release_waits_for_its_workspaces_hung_heavy_job(
    world: tuple[Config, Store, str, str],
) -> None:
    cfg, store, a, b = world
    heavy = HeavyPool(60.0, size=4)
    backend = LocalBackend()
    executor = RealExecutor(LiveConfig(cfg), StoreWorker(store), backend, heavy=heavy)
    done: list[str] = []

    async def release(key: str) -> None:
        await executor.waker.release(key, 1)
        done.append(key)

    async def main() -> None:
        async with anyio.create_task_group() as served:
            await served.start(backend.run)
            async with anyio.create_task_group() as tg:
                hold = threading.Event()
                tg.start_soon(heavy.run, a, hold.wait, 30.0)
                await anyio.sleep(0.05)
                tg.start_soon(release, a)
                with anyio.fail_after(10):
                    await release(b)  # another workspace goes on
                await anyio.sleep(0.5)
                assert done == [b], "A's release ran while A's heavy job was out"
                hold.set()
            assert done == [b, a]
            served.cancel_scope.cancel()

    anyio.run(main)


def test_the_legacy_ref_look_waits_for_its_workspaces_hung_heavy_job(
    world: tuple[Config, Store, str, str],
) -> None:
    cfg, store, a, b = world
    heavy = HeavyPool(60.0, size=4)
    evaluation = SubmitEvaluation(LiveConfig(cfg), StoreWorker(store), heavy)
    repos = Path(cfg.run_dir) / "repos"
    marker = repos / f"{a}.git" / R.LEGACY_REPORTED  # written by the look at A's .git
    ran: list[str] = []

    async def upgrade() -> None:
        await evaluation.run()
        ran.append("upgrade")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            hold = threading.Event()
            tg.start_soon(heavy.run, a, hold.wait, 30.0)
            await anyio.sleep(0.05)
            tg.start_soon(upgrade)
            await anyio.sleep(0.5)
            assert ran == []
            assert not marker.exists(), "A's .git was looked at while A's heavy job was out"
            assert (repos / f"{b}.git" / R.LEGACY_REPORTED).exists(), "B waited for A"
            hold.set()
        assert ran == ["upgrade"]
        assert marker.exists()

    anyio.run(main)
