"""One home per concern, by composition: no kernel class extends another kernel class (exceptions and protocols
aside), and no module reaches into another module's private names.

The executor is composed of parts with one job each (kernel.service.dispatch, tracking, waking, upkeep) and is
given its evaluation as a strategy (kernel.service.evaluation); a subclass overriding private methods (as
`SubmitExecutor(RealExecutor)` did) couples two modules through names neither documents, so it is refused here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "kernel"
MODULES = sorted(KERNEL.rglob("*.py"))
# Modules of the standard library whose underscore names are documented API (os._exit).
STDLIB_PRIVATE_OK = {"os", "sys"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _inherited_kernel_classes(mod: types.ModuleType) -> list[str]:
    module = mod.__name__
    bad = []
    for name, cls in inspect.getmembers(mod, inspect.isclass):
        if cls.__module__ != module:
            continue
        for base in cls.__mro__[1:]:
            own = base.__module__.startswith(("kernel.", "channel."))
            if not own or issubclass(base, BaseException) or getattr(base, "_is_protocol", False):
                continue
            bad.append(f"{module}.{name} extends {base.__module__}.{base.__qualname__}")
    return bad


SERVICE = [p for p in MODULES if p.parent.name == "service" and p.name != "__init__.py"]


@pytest.mark.parametrize("path", SERVICE, ids=lambda p: p.name)
def test_service_classes_compose_instead_of_extending(path: Path) -> None:
    bad = _inherited_kernel_classes(importlib.import_module(_module_name(path)))
    assert not bad, f"{bad}: give the class its parts (or a strategy) instead of subclassing"


def _private_uses(path: Path) -> list[str]:
    """`X._name` where X is not self/cls and `_name` is not defined in this file, and `from kernel... import _n`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", *STDLIB_PRIVATE_OK):
                continue
            if node.attr not in own:
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("kernel", "channel"))
        ):
            bad.extend(
                f"{path.name}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_")
            )
    return bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(KERNEL)))
def test_no_module_uses_another_modules_private_names(path: Path) -> None:
    bad = _private_uses(path)
    assert not bad, f"{bad}: make the name public (documented) in its module, or do not use it"


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text(
        "from kernel.backends import jobscript\nfrom kernel.io.store import _SCHEMA\n"
        "def f(x):\n    jobscript._write(x)\n    x.tracker._sweep()\n    self._mine()\n    os._exit(1)\n"
    )
    found = _private_uses(sample)
    assert len(found) == 3, found
    assert any("jobscript._write" in f for f in found)
    assert any("x.tracker._sweep" in f for f in found)
    assert any("import _SCHEMA" in f for f in found)

    mod = types.ModuleType("kernel.service.sample")
    exec(
        "from kernel.service.execute import RealExecutor\n"
        "class SubmitExecutor(RealExecutor):\n    pass\n"
        "class Fine(Exception):\n    pass\n",
        mod.__dict__,
    )
    assert _inherited_kernel_classes(mod) == [
        "kernel.service.sample.SubmitExecutor extends kernel.service.execute.RealExecutor"
    ]
