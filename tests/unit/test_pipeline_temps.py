"""The pipeline's ageing-out of abandoned temps: bounded batches, a cursor that moves on, no re-listing for young
ones. Real store, real enrollment, real directories; only the kernel's clock is set by the test."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from _parts import T0, Clock, enrolled

from kernel.core.config import Config, ConfigError, LiveConfig, parse
from kernel.io.store import Store, StoreWorker
from kernel.service.executor import PendingExecutor
from kernel.service.pipeline import TEMPS_PER_LISTING, Pipeline


def make_temps(rq: Path, prefix: str, n: int, mtime: float) -> None:
    for i in range(n):
        p = rq / f".{prefix}{i:03d}.tmp"
        p.write_bytes(b"{")
        os.utime(p, (mtime, mtime))


def test_batches_resume_after_the_last_name_and_young_temps_are_not_relisted(
    tmp_path: Path, cfg: Config, store: Store
) -> None:
    ws, row = enrolled(tmp_path, store, cfg)
    rq = ws / ".syscall" / "requests"
    clock = Clock()
    worker = StoreWorker(store)
    pipeline = Pipeline(LiveConfig(cfg), worker, PendingExecutor(worker), clock=clock)
    pipeline.set_workspaces([row])
    assert cfg.temp_grace_minutes == 10
    make_temps(rq, "a", 300, T0 - 60)  # young: a minute old
    make_temps(rq, "z", 100, T0 - 11 * 60)  # stale

    def listing_pass() -> None:
        pipeline.mark(row.key)  # an event or a rescan
        anyio.run(pipeline.run_pass)

    def names(prefix: str) -> int:
        return sum(1 for n in os.listdir(rq) if n.startswith(f".{prefix}"))

    listing_pass()  # .a000-.a255: all young, nothing removed, no second listing asked for
    assert (names("a"), names("z")) == (300, 100)
    assert not pipeline.has_work()

    listing_pass()  # goes on after .a255: .a256-.a299, all of .z, then wraps to .a000-.a111
    assert (names("a"), names("z")) == (300, 0)
    assert pipeline.has_work(), "stale temps were found and more names were left: list again"
    anyio.run(pipeline.run_pass)  # .a112-.a299, .a000-.a067: young, stop
    assert names("a") == 300
    assert not pipeline.has_work()

    clock.now = T0 + 9 * 60 + 1  # the .a temps are now just over 10 minutes old
    listing_pass()
    assert names("a") == 300 - TEMPS_PER_LISTING
    assert pipeline.has_work()
    anyio.run(pipeline.run_pass)
    assert os.listdir(rq) == []
    assert not pipeline.has_work()


def test_the_grace_is_a_config_key_in_minutes_with_a_floor() -> None:
    assert parse("temp_grace_minutes = 45", "<t>", env={}).temp_grace_minutes == 45
    with pytest.raises(ConfigError, match=r"<t>: key 'temp_grace_minutes' .*>= 1"):
        parse("temp_grace_minutes = 0.5", "<t>", env={})
    with pytest.raises(ConfigError, match=r"key 'temp_grace_minutes'"):
        parse("temp_grace_minutes = 'ten'", "<t>", env={})
