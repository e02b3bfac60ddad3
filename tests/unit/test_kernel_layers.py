"""The kernel's layers import one way only: channel <- core <- io <- backends <- service <- cli/demo; node alone.

- `kernel.core`: pure decisions and records; it imports `channel` and itself only (no I/O framework either).
- `kernel.node`: what runs on a compute node (the wrapper) and the jail argv builders: no other kernel layer.
- `kernel.io` (the kernel's own I/O), `kernel.backends` (the backend contract and its implementations),
  `kernel.service` (the async process), then `kernel.cli` and `kernel.demo` on top.
A module may import its own layer and any layer below it, never one above. Late imports (inside a function)
count as well: they hide a cycle, they do not remove it. And no module imports itself back through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "kernel"
# layer -> the layers it may import (besides itself and the standard library / third-party packages)
ALLOWED: dict[str, set[str]] = {
    "channel": set(),
    "core": {"channel"},
    "node": set(),
    "io": {"channel", "core", "node"},
    "backends": {"channel", "core", "node", "io"},
    "service": {"channel", "core", "node", "io", "backends"},
    "top": {"channel", "core", "node", "io", "backends", "service"},
}
CORE_FORBIDDEN = {"anyio", "watchdog", "subprocess", "sqlite3", "asyncio", "threading", "socket", "shutil"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "channel":
        return "channel"
    if parts[0] != "kernel":
        return None
    if len(parts) == 1 or parts[1] in ("cli", "demo"):
        return "top"
    return parts[1]


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (`from kernel.x import y` counts kernel.x.y if it is a
    module, else kernel.x)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if _is_module(full) else node.module)
    return names


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


MODULES = sorted(KERNEL.rglob("*.py"))


def test_every_kernel_module_is_in_a_layer() -> None:
    known = set(ALLOWED)
    stray = [_module_name(p) for p in MODULES if _layer(_module_name(p)) not in known]
    assert not stray, f"{stray}: put each module in kernel/core, io, node, backends or service"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(KERNEL)))
def test_imports_flow_down_the_layers(path: Path) -> None:
    me = _module_name(path)
    mine = _layer(me)
    assert mine is not None
    bad = sorted(
        m
        for m in _imports(path)
        if (theirs := _layer(m)) is not None and theirs != mine and theirs not in ALLOWED[mine]
    )
    assert not bad, f"{me} ({mine}) imports {bad}; {mine} may import only {sorted(ALLOWED[mine])}"


@pytest.mark.parametrize("path", sorted((KERNEL / "core").rglob("*.py")), ids=lambda p: p.name)
def test_core_does_no_io(path: Path) -> None:
    bad = {m.split(".")[0] for m in _imports(path)} & CORE_FORBIDDEN
    assert not bad, f"{path.name} imports {sorted(bad)}; kernel/core holds pure decisions only"


# The serve core and the poll schedule are sans-IO state machines (events in, actions out; h11's habit): not even
# the operating system, the clock or a file. The service's driver (kernel.service.loop) does all of that.
SANS_IO = ("serving.py", "polling.py")
SANS_IO_FORBIDDEN = {
    "os",
    "io",
    "pathlib",
    "time",
    "select",
    "signal",
    "fcntl",
    "tempfile",
    "glob",
    "logging",
}
SANS_IO_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def _sans_io_problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [f"imports {m}" for m in sorted({m.split(".")[0] for m in _imports(path)} & SANS_IO_FORBIDDEN)]
    bad += [
        f"calls {node.func.id}() at line {node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SANS_IO_CALLS
    ]
    return bad


@pytest.mark.parametrize("name", SANS_IO)
def test_the_serve_core_is_sans_io(name: str) -> None:
    bad = _sans_io_problems(KERNEL / "core" / name)
    assert not bad, f"kernel/core/{name}: {bad}; it takes events and returns actions, the driver does the I/O"


def test_the_sans_io_check_sees_a_violation(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import os.path\nimport time\ndef f():\n    return open('x')\n")
    assert _sans_io_problems(sample) == ["imports os", "imports time", "calls open() at line 4"]


def test_node_is_stdlib_only() -> None:
    # wrapper.py runs on compute nodes with whatever python3 they have: nothing outside the standard library
    bad = {m.split(".")[0] for m in _imports(KERNEL / "node" / "wrapper.py")} - set(_stdlib())
    assert not bad, f"kernel/node/wrapper.py imports {sorted(bad)}"


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names) | {"__future__"}


def test_no_import_cycles() -> None:
    graph = {
        _module_name(p): {m for m in _imports(p) if m.startswith("kernel") and _is_module(m)} for p in MODULES
    }
    # packages' __init__ are imported by their children implicitly; only real edges count
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if seen.get(n) == 1:
                cycle = [*stack[stack.index(n) :], n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import subprocess\ndef f():\n    from kernel.service import pipeline\n")
    found = _imports(sample)
    assert "subprocess" in found
    assert "kernel.service.pipeline" in found
    assert _layer("kernel.service.pipeline") not in ALLOWED["core"]
    assert _layer("kernel.cli") == "top"
