"""The service (kernel.service.loop) composes its parts and owns none of their state: it gives each part what it
needs at construction (`PipelineHooks`, callbacks, `publish`, `on_stop`) and never writes an attribute of another
object (`self.pipeline.on_idle = ...`, `svc.publish = ...`, `self.refresher.stale = ...`). State written from
outside its object has no one owner: who changed it, from which thread, is then anyone's guess."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The modules held to it.
CHECKED = [ROOT / "kernel" / "service" / "loop.py"]


def _foreign_writes(path: Path) -> list[str]:
    """Every assignment (plain, augmented, annotated), deletion or setattr()/delattr() of an attribute of anything
    but `self` itself, as `file:line: target`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for x in ast.walk(target):
                if (
                    isinstance(x, ast.Attribute)
                    and isinstance(x.ctx, ast.Store | ast.Del)
                    and not (isinstance(x.value, ast.Name) and x.value.id == "self")
                ):
                    bad.append(f"{path.name}:{x.lineno}: {ast.unparse(x)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
        ):
            bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return bad


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.name)
def test_the_service_writes_no_attribute_of_another_object(path: Path) -> None:
    bad = _foreign_writes(path)
    assert not bad, (
        f"{bad}: give the part what it needs at construction (kernel.service.pipeline.PipelineHooks, a callback) "
        "or call a method of its own that changes its state"
    )


def test_the_check_sees_every_kind_of_write(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text(
        "def f(self, svc, xs):\n"
        "    self.fine = 1\n"
        "    self.d[svc.key] = 2\n"
        "    self.pipeline.on_idle = None\n"
        "    svc.publish = print\n"
        "    svc.count += 1\n"
        "    a, self.refresher.stale = 1, 2\n"
        "    del svc.gone\n"
        "    setattr(svc, 'x', 1)\n"
        "    svc.m(x=1)\n"
        "    xs.append(1)\n"
    )
    found = _foreign_writes(sample)
    assert [f.split(": ", 1)[1] for f in found] == [
        "self.pipeline.on_idle",
        "svc.publish",
        "svc.count",
        "self.refresher.stale",
        "svc.gone",
        "setattr(svc, 'x', 1)",
    ]
