"""The kernel's own directories and files, named in one place (as channel.paths names the protocol's).

`<state_dir>/` holds the store (`state.sqlite`, with sqlite's `-wal` and `-shm` beside it), the lock of the kernel
serving it (`kernel.lock`, kernel.io.statedir) and the kernel's scratch (`tmp/`: snapshots and base imports being
made). `<run_dir>/`, by default `<state_dir>/runs`, holds the environment caches (`envs/`, kernel.io.envcache)
and what compute nodes read too, named by channel.paths.RunPaths: the run directories and the kernel's repository
of each workspace (`repos/<key>.git`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class StatePaths:
    state_dir: Path
    run_dir: Path

    STORE: ClassVar[str] = "state.sqlite"
    LOCK: ClassVar[str] = "kernel.lock"
    TMP: ClassVar[str] = "tmp"
    RUNS: ClassVar[str] = "runs"  # the run_dir when the config names none
    ENVS: ClassVar[str] = "envs"

    @classmethod
    def at(
        cls, state_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str] | None = None
    ) -> StatePaths:
        state = Path(state_dir)
        return cls(state, state / cls.RUNS if run_dir is None else Path(run_dir))

    @property
    def store(self) -> Path:
        return self.state_dir / self.STORE

    @property
    def lock(self) -> Path:
        return self.state_dir / self.LOCK

    @property
    def tmp(self) -> Path:
        return self.state_dir / self.TMP

    @property
    def envs(self) -> Path:
        return self.run_dir / self.ENVS
