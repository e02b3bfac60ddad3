"""The store is the only code that speaks SQL to the kernel's database: everyone else calls its public methods.

No module of the kernel outside `kernel/io/store.py` touches a private name of the store (its `_one`/`_all`/`_conn`
or any other `_name` on a `Store`, or a private module-level name of kernel.io.store), and no module outside it
creates or alters a table (every table is made by the store's migrations at open).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "kernel"
STORE = KERNEL / "io" / "store.py"


def _private_store_names() -> tuple[set[str], set[str]]:
    """(private names on the Store class, private module-level names of kernel.io.store)."""
    tree = ast.parse(STORE.read_text())
    members: set[str] = set()
    module: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            if node.name.startswith("_"):
                module.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        module |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.startswith("_")}
        if isinstance(node, ast.ClassDef) and node.name == "Store":
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("_"):
                    members.add(sub.name)
                elif isinstance(sub, ast.Attribute) and sub.attr.startswith("_"):
                    members.add(sub.attr)
                elif isinstance(sub, ast.Name) and sub.id.startswith("_") and isinstance(sub.ctx, ast.Store):
                    members.add(sub.id)
    dunder = {n for n in members | module if n.startswith("__") and n.endswith("__")}
    return members - dunder, module - dunder


def private_store_uses(path: Path, members: set[str], module: set[str], root: Path = ROOT) -> list[str]:
    """`where: what` for every private store name used in `path` (an attribute on anything but `self`/`cls`,
    or an import of a private name from kernel.io.store)."""
    out: list[str] = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in members:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # the module's own member of that name (pipeline's `_one`), not the store's
            out.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "kernel.io.store":
            out += [
                f"{path.relative_to(root)}:{node.lineno}: {a.name}" for a in node.names if a.name in module
            ]
    return out


def _kernel_modules() -> list[Path]:
    return sorted(p for p in KERNEL.rglob("*.py") if p != STORE)


def test_the_store_has_the_private_names_this_test_looks_for() -> None:
    members, module = _private_store_names()
    assert {"_one", "_all", "_conn"} <= members
    assert "_SCHEMA" in module


def test_no_kernel_module_outside_the_store_touches_a_private_store_name() -> None:
    members, module = _private_store_names()
    found = [u for p in _kernel_modules() for u in private_store_uses(p, members, module)]
    assert not found, (
        "private store names used outside kernel/io/store.py (add a public method):\n" + "\n".join(found)
    )


def test_the_check_sees_the_uses_it_forbids(tmp_path: Path) -> None:
    members, module = _private_store_names()
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kernel.io.store import _SCHEMA\n"
        "def f(store, self):\n"
        "    store._one('SELECT 1')\n"
        "    self.store._all('SELECT 1')\n"
        "    self._one(1)\n"  # a module's own method of that name: allowed
    )
    uses = sorted(u.split(": ", 1)[1] for u in private_store_uses(bad, members, module, tmp_path))
    assert uses == ["._all", "._one", "_SCHEMA"]


_DDL = re.compile(r"\b(CREATE\s+(TABLE|INDEX|UNIQUE\s+INDEX)|ALTER\s+TABLE|DROP\s+TABLE)\b", re.IGNORECASE)


def test_no_kernel_module_outside_the_store_creates_or_alters_a_table() -> None:
    found = []
    for p in _kernel_modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DDL.search(node.value):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not found, "tables made outside the store's migrations:\n" + "\n".join(found)
