"""Where the service's executor and its backend are built from the config: the one place that knows them all.

`execute` (the composed executor) and `submitexec` (the submit's evaluation strategy) never import this module
nor each other: the factory gives the executor its strategy.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable

from kernel.backends.base import RunnableBackend
from kernel.core.config import Config, ConfigError, LiveConfig
from kernel.io import log as klog
from kernel.io.store import StoreWorker
from kernel.node.jail import NONE_WARNING
from kernel.service.execute import RealExecutor
from kernel.service.executor import Executor, PendingExecutor
from kernel.service.heavy import HeavyPool
from kernel.service.submitexec import SubmitEvaluation


def make_backend(cfg: Config) -> RunnableBackend:
    """The one place a backend is constructed from the config."""
    match cfg.backend:
        case "local":
            from kernel.backends.local import LocalBackend

            return LocalBackend(
                max_parallel=cfg.local.max_parallel or None,
                seconds_per_minute=cfg.local.seconds_per_minute,
            )
        case "slurm":
            from kernel.backends.slurm.backend import SlurmBackend

            return SlurmBackend.from_config(cfg.slurm)
        case _:
            raise ConfigError(f"{cfg.source}: key 'backend' {cfg.backend!r} runs no jobs")


def executor_factory(live: LiveConfig) -> Callable[[StoreWorker], Executor]:
    """What `serve` builds its executor with: the configured backend, or none (`backend = "none"`). The executor
    reads `live` at each use; the backend and the jail are chosen here, once."""
    cfg = live.current
    if cfg.backend == "none":
        return PendingExecutor
    if cfg.jail == "none":
        klog.event("jail_none", logging.WARNING, warning=NONE_WARNING)
    elif cfg.jail == "bwrap" and shutil.which("bwrap") is None:
        raise ConfigError(
            f"{cfg.source}: key 'jail' is 'bwrap' but bwrap is not installed (apt-get install bubblewrap), "
            "or set jail = 'none' on a single-user laptop"
        )
    backend = make_backend(cfg)

    def build(worker: StoreWorker) -> Executor:
        heavy = HeavyPool(lambda: live.current.heavy_io_deadline_seconds)
        return RealExecutor(
            live, worker, backend, evaluation=SubmitEvaluation(live, worker, heavy), heavy=heavy
        )

    return build
