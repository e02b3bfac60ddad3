"""Fixtures the unit tests of the kernel's parts share: a config with its own state dir, and the real store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel.core.config import Config, parse
from kernel.io.store import Store


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    """The defaults, with the state dir in the test's own directory (a module may override it)."""
    return parse(f'state_dir = "{tmp_path}/state"\n', "<test>", env={})


@pytest.fixture
def store(cfg: Config) -> Iterator[Store]:
    """The real store of `cfg`, closed after the test."""
    s = Store.open(cfg.paths.store)
    yield s
    s.close()
