"""What several unit tests of the kernel's parts build alike: a tool to install, a clock the test sets, and an
enrolled workspace (real git, real enrollment)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio

from kernel.core.config import Config
from kernel.core.records import WorkspaceRow
from kernel.io.enroll import Grant, enroll
from kernel.io.install import ToolSource
from kernel.io.store import Store
from kernel.service.notify import Notifier


class ReadyNotifier(Notifier):
    """A notifier whose `is_ready` is set when the service says READY=1."""

    def __init__(self) -> None:
        super().__init__(None, None)
        self.is_ready = anyio.Event()

    def ready(self, status: str) -> None:
        self.is_ready.set()


TOOL = ToolSource(b'#!/usr/bin/env python3\nVERSION = "9.9"\nsub.add_parser("status")\n')
T0 = 1_800_000_000.0


class Clock:
    """time.time() as the test sets it (`now`), from T0."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def enrolled(
    tmp_path: Path, store: Store, cfg: Config, grant: Grant | None = None
) -> tuple[Path, WorkspaceRow]:
    """A new git workspace at `tmp_path/ws`, enrolled with `TOOL` (and `grant`): the workspace and its row."""
    ws = tmp_path / "ws"
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    return ws, enroll(store, cfg, str(ws), TOOL, Grant() if grant is None else grant).row
