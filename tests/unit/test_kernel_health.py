"""When the service says it is healthy (and so pings systemd's watchdog)."""

from __future__ import annotations

import time
from pathlib import Path

from kernel.core.config import LiveConfig, parse
from kernel.io.install import ToolSource
from kernel.io.store import Store
from kernel.service.loop import Service
from kernel.service.notify import Notifier


def service(tmp_path: Path) -> Service:
    cfg = parse(f'state_dir = "{tmp_path}"\nstall_seconds = 5\n', "<test>", env={})
    return Service(LiveConfig(cfg), Store.open(cfg.paths.store), Notifier(None, None), ToolSource(b""))


class DeadWatcher:
    def healthy(self) -> bool:
        return False


def test_health_follows_passes_watcher_and_stopping(tmp_path: Path) -> None:
    svc = service(tmp_path)
    assert svc.healthy()
    svc.pipeline.pass_started = time.time() - 1
    assert svc.healthy()
    svc.pipeline.pass_started = time.time() - 6
    assert not svc.healthy(), "a pass stalled past stall_seconds"
    svc.pipeline.pass_started = None
    svc.watcher = DeadWatcher()  # type: ignore[assignment]
    assert not svc.healthy(), "the inotify reader thread died"
    svc.watcher = None
    svc.stop("test")
    assert not svc.healthy(), "no pings while draining"
    svc.store.close()
