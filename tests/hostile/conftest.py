"""Fixtures the hostile-channel tests share: an empty workspace directory and its channel, opened (made) by the
kernel's safe filesystem layer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from channel.safefs import Channel, open_channel


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


@pytest.fixture
def ch(ws: Path) -> Iterator[Channel]:
    with open_channel(ws, create=True) as channel:
        yield channel
