"""Background environment builds (kernel.service.building) and the build's lock across processes
(kernel.io.envcache.EnvCache.build): one build per key, every waiting sleep told, at most `max_builds` at once, a
dead builder's build done again, a live one's waited for.

`Builds` runs against a fake cache whose builds the test finishes (pure bookkeeping); the lock is the real
EnvCache with a real flock and a real process holding it (uv is `/bin/false`: the build itself fails at once).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest

from kernel.core.config import EnvironmentConfig
from kernel.io import envcache as E
from kernel.node.jail import JailPolicy
from kernel.service.building import Builds

Sleep = tuple[str, int]


def prepared(key: str) -> E.Prepared:
    project = E.LockedProject(pyproject=b"[project]\n", lock=f"lock {key}\n".encode())
    return E.Prepared(key, project, (b"", b""))


class FakeCache:
    """`build` waits until the test sets the key's event; `fail` names the keys whose build fails."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.go: dict[str, anyio.Event] = {}
        self.fail: set[str] = set()
        self.pruned = 0  # builds over (each ready one prunes)

    async def build(self, p: E.Prepared, *, on_output: object = None) -> tuple[E.EnvReady, bool]:
        self.calls.append(p.key)
        assert callable(on_output)
        on_output(b"Resolved 1 package\nDownloading " + p.key.encode() + b"\n")
        await self.go.setdefault(p.key, anyio.Event()).wait()
        if p.key in self.fail:
            raise E.EnvironmentFailed(f"uv could not install {p.key}")
        ready = E.EnvReady(
            key=p.key,
            lock_sha256=p.project.lock_sha256,
            python="/usr/bin/python3",
            python_version="3.11",
            uv_version="uv 0",
            packages=(),
            warm_seconds=0.0,
        )
        return ready, True

    def prune(self) -> list[str]:
        self.pruned += 1
        return []


class Harness:
    def __init__(self, slots: int = 2) -> None:
        self.cache = FakeCache()
        self.ready: list[Sleep] = []
        self.failed: list[tuple[Sleep, str]] = []
        self.builds = Builds(self.cache, lambda: slots, self.on_ready, self.on_failed)  # type: ignore[arg-type]

    async def on_ready(self, sleep: Sleep) -> None:
        self.ready.append(sleep)

    async def on_failed(self, sleep: Sleep, error: str) -> None:
        self.failed.append((sleep, error))


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(3000):
        if cond():
            return
        await anyio.sleep(0.01)
    raise AssertionError("the condition never held")


async def settle() -> None:
    for _ in range(50):
        await anyio.lowlevel.checkpoint()


def run(body: object) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(h.builds.run)
            await settle()
            await body(h)  # type: ignore[operator]
            tg.cancel_scope.cancel()

    h = Harness()
    anyio.run(main)


def test_sleeps_needing_one_lock_share_one_build_and_all_run_when_it_is_ready() -> None:
    async def body(h: Harness) -> None:
        a, b = ("ws-a", 1), ("ws-b", 4)
        h.builds.want(a, [prepared("k1")])
        h.builds.want(b, [prepared("k1")])
        await settle()
        assert h.cache.calls == ["k1"]
        view = h.builds.view(a, lines=1)
        assert view is not None
        assert (view.state, view.log_tail) == ("building", "Downloading k1")
        assert view.started_at is not None
        assert h.builds.log_tail(b, 5) == ("Resolved 1 package\nDownloading k1", 34, False)
        assert h.builds.log_tail(b, 1) == ("Downloading k1", 34, True)
        h.cache.go["k1"].set()
        await until(lambda: len(h.ready) == 2)  # after the build's prune, in a thread
        assert sorted(h.ready) == [a, b]
        assert h.failed == []
        assert not h.builds.waiting(a)
        got = h.builds.view(a)
        assert got is not None
        assert got.state == "ready"
        h.builds.forget(a)
        assert h.builds.view(a) is None

    run(body)


def test_a_failed_build_tells_every_sleep_waiting_for_it() -> None:
    async def body(h: Harness) -> None:
        h.cache.fail.add("k1")
        h.builds.want(("a", 1), [prepared("k1")])
        h.builds.want(("b", 1), [prepared("k1")])
        await settle()
        h.cache.go["k1"].set()
        await until(lambda: len(h.failed) == 2)
        assert sorted(h.failed) == [
            (("a", 1), "uv could not install k1"),
            (("b", 1), "uv could not install k1"),
        ]
        assert h.ready == []

    run(body)


def test_a_sleep_waiting_for_two_builds_runs_once_both_are_ready() -> None:
    async def body(h: Harness) -> None:
        h.builds.want(("a", 1), [prepared("own"), prepared("base")])
        await settle()
        h.cache.go["own"].set()
        await until(lambda: h.cache.pruned == 1)  # the build of `own` is over
        await settle()
        assert h.ready == []
        assert h.builds.waiting(("a", 1))
        h.cache.go["base"].set()
        await until(lambda: bool(h.ready))
        assert h.ready == [("a", 1)]

    run(body)


def test_at_most_max_builds_run_at_once_and_a_queued_one_says_so() -> None:
    async def body(h: Harness) -> None:
        for n in range(3):
            h.builds.want((f"ws{n}", 1), [prepared(f"k{n}")])
        await settle()
        assert h.cache.calls == ["k0", "k1"]
        queued = h.builds.view(("ws2", 1))
        assert queued is not None
        assert (queued.state, queued.started_at) == ("building", None)
        h.cache.go["k0"].set()
        await until(lambda: len(h.cache.calls) == 3)
        assert h.cache.calls == ["k0", "k1", "k2"]

    run(body)


# --- the build's lock across processes (real flock, real processes) ------------------------------------------


def cache(root: Path) -> E.EnvCache:
    return E.EnvCache(EnvironmentConfig(), root, jail=JailPolicy(kind="none"), uv="/bin/false")


def test_a_build_whose_builder_died_is_found_stale_and_built_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A builder record with its flock free (the kernel that wrote it was SIGKILLed mid-build, its temp entry
    left behind): the next build removes the leftovers and builds; it does not wait."""
    root = tmp_path / "envs"
    c = cache(root)
    p = prepared("k" * 32)
    (root / E.BUILDS_DIR).mkdir(parents=True)
    dead = E.Builder(pid=999999, started_at="2026-12-03T00:00:00.000Z", lock_sha256=p.project.lock_sha256)
    (root / E.BUILDS_DIR / f"{p.key}.json").write_bytes(msgspec.json.encode(dead))
    left = root / f".{p.key}.999999.1.tmp"
    (left / "uv").mkdir(parents=True)
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(E.EnvironmentFailed, match="exited with status 1 and said nothing"),
    ):
        anyio.run(c.build, p)  # uv is /bin/false: the build runs, and fails
    assert "environment_build_stale" in caplog.text
    assert not left.exists()
    assert not (root / E.BUILDS_DIR / f"{p.key}.json").exists()


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").write("held")
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
"""


def test_a_build_held_by_a_live_process_is_waited_for_not_redone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds the key's flock (it builds): the build waits for it to let go, and finds the entry
    that process made instead of building it again."""
    root = tmp_path / "envs"
    c = cache(root)
    p = prepared("h" * 32)
    (root / E.BUILDS_DIR).mkdir(parents=True)
    held, release = tmp_path / "held", tmp_path / "release"
    lock = root / E.BUILDS_DIR / f"{p.key}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(held), str(release)])
    got: list[tuple[E.EnvReady, bool]] = []
    try:

        async def main() -> None:
            await until(held.exists)
            async with anyio.create_task_group() as tg:

                async def build() -> None:
                    got.append(await c.build(p))

                tg.start_soon(build)
                await until(lambda: "environment_build_waiting" in caplog.text)
                # what the other process built, published before it lets the lock go
                entry = root / p.key
                entry.mkdir()
                ready = E.EnvReady(
                    key=p.key,
                    lock_sha256=p.project.lock_sha256,
                    python="/usr/bin/python3",
                    python_version="3.11",
                    uv_version="uv 0",
                    packages=(("six", "1.16.0"),),
                    warm_seconds=1.0,
                )
                (entry / E.READY).write_bytes(msgspec.json.encode(ready))
                release.touch()

        with caplog.at_level(logging.INFO):
            anyio.run(main)
    finally:
        release.touch()
        holder.wait(30)
    [(ready, built)] = got
    assert (ready.packages, built) == ((("six", "1.16.0"),), False)
    assert holder.returncode == 0
