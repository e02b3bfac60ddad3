"""`channel/` is the protocol core: it must not import I/O frameworks, and nothing in it imports the kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CHANNEL = Path(__file__).resolve().parents[2] / "channel"
FORBIDDEN = {"anyio", "watchdog", "subprocess", "sqlite3", "kernel", "tool", "asyncio", "threading", "socket"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", sorted(CHANNEL.glob("*.py")), ids=lambda p: p.name)
def test_channel_imports_no_io_framework(module: Path) -> None:
    bad = _imports(module) & FORBIDDEN
    assert not bad, f"{module.name} imports {sorted(bad)}; channel/ must stay free of I/O frameworks"


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import subprocess\nfrom anyio import run\n")
    assert _imports(sample) & FORBIDDEN == {"subprocess", "anyio"}


SPEC = CHANNEL.parent / "spec"


@pytest.mark.parametrize("module", sorted(SPEC.rglob("*.py")), ids=lambda p: str(p.relative_to(SPEC)))
def test_the_conformance_runner_sees_no_kernel(module: Path) -> None:
    # black-box: the runner knows an implementation only through its channel's files
    bad = _imports(module) & {"kernel", "tool"}
    assert not bad, f"{module.name} imports {sorted(bad)}; spec/ must not depend on an implementation"
