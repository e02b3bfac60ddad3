"""Every process the kernel starts on its host goes through one gate, `kernel.io.hostproc` (threat-model.md,
"Host processes").

The gate's rule, no agent-controlled byte executed or interpreted on the host outside a jail, is held per call
site: each one is a declared `Site` saying what agent input reaches the process and how it is contained. That
holds only while no module starts a process another way, which this test enforces the way the layering test
enforces imports: by reading every module of `kernel/`.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from kernel.io import hostproc

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "kernel"
GATE = KERNEL / "io" / "hostproc.py"
# The job wrapper is a separate program, rendered into each job script and run on the node; it is the jail's own
# launcher (kernel.node.jail builds its argv) and imports nothing of the kernel.
NODE_PROGRAM = KERNEL / "node" / "wrapper.py"
MODULES = sorted(p for p in KERNEL.rglob("*.py") if p not in (GATE, NODE_PROGRAM))

FORBIDDEN_MODULES = {"subprocess", "pty", "multiprocessing", "concurrent.futures.process"}
FORBIDDEN_ATTRS = {
    "os": re.compile(r"(exec\w*|spawn\w*|posix_spawn\w*|system|popen|fork\w*)"),
    "anyio": re.compile(r"(run_process|open_process)"),
    "asyncio": re.compile(r"create_subprocess_\w+"),
}


def starts(tree: ast.AST) -> list[str]:
    """What in `tree` starts a process outside the gate (or imports what does)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in FORBIDDEN_MODULES:
                found.append(f"from {node.module} import ...")
            pattern = FORBIDDEN_ATTRS.get(node.module)
            found += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if pattern and pattern.fullmatch(a.name)
            ]
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            pattern = FORBIDDEN_ATTRS.get(base or "")
            if pattern is not None and pattern.fullmatch(node.attr):
                found.append(f"{base}.{node.attr}")
            if node.attr == "Popen" and base != "hostproc":
                found.append(f"{base}.Popen")
        elif isinstance(node, ast.Name) and node.id == "Popen":
            found.append("Popen")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(KERNEL)))
def test_no_module_starts_a_process_except_through_the_gate(path: Path) -> None:
    found = starts(ast.parse(path.read_text(), filename=str(path)))
    assert not found, (
        f"{path.relative_to(ROOT)} starts processes itself ({', '.join(found)}): declare a kernel.io.hostproc "
        "Site (what agent input reaches it, how it is contained) and start it through hostproc"
    )


@pytest.mark.parametrize(
    "source",
    [
        "import subprocess",
        "from subprocess import run",
        "os.execv('/bin/sh', [])",
        "os.posix_spawnp('sh', [], {})",
        "anyio.run_process(['x'])",
        "from anyio import open_process",
        "asyncio.create_subprocess_exec('x')",
        "x = sp.Popen",
        "os.system('x')",
    ],
)
def test_the_scan_sees_each_way_of_starting_a_process(source: str) -> None:
    assert starts(ast.parse(source))


def _all_sites() -> dict[str, hostproc.Site]:
    for path in sorted(KERNEL.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if path != NODE_PROGRAM:
            importlib.import_module(name)
    return dict(hostproc.SITES)


def test_every_site_says_what_reaches_it_and_how_it_is_contained_and_is_documented() -> None:
    sites = _all_sites()
    assert {"git", "git.stream", "local.wrapper", "slurm.client", "on_verdict"} <= set(sites)
    doc = (ROOT / "docs" / "threat-model.md").read_text()
    section = doc.split("### Host processes", 1)[1].split("\n### ", 1)[0]
    for name, site in sites.items():
        assert site.agent_input.strip(), name
        assert site.containment.strip(), name
        assert f"`{name}`" in section, f"docs/threat-model.md's Host processes section does not list `{name}`"


def test_run_kills_a_process_past_its_deadline_and_past_its_output_cap() -> None:
    site = hostproc.Site("test.capped", "none", "a test", timeout_s=0.5, output_cap=1000)
    with pytest.raises(hostproc.TimeoutExpired):
        hostproc.run(site, ["sleep", "30"])
    with pytest.raises(hostproc.OutputTooLarge):
        hostproc.run(site, ["sh", "-c", "yes | head -c 100000; sleep 30"])
    done = hostproc.run(site, ["sh", "-c", "cat; echo err >&2"], input=b"x" * 500)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"x" * 500, b"err\n")


def test_run_async_kills_a_process_past_its_deadline_and_past_its_output_cap() -> None:
    import anyio

    site = hostproc.Site("test.async", "none", "a test", timeout_s=0.5, output_cap=1000)

    async def main() -> None:
        with pytest.raises(hostproc.TimeoutExpired):
            await hostproc.run_async(site, ["sleep", "30"])
        with pytest.raises(hostproc.OutputTooLarge):
            await hostproc.run_async(site, ["sh", "-c", "yes | head -c 100000; sleep 30"])
        # a child that outlives the killed process holds the other pipe open: the cap still ends the wait
        with pytest.raises(hostproc.OutputTooLarge):
            await hostproc.run_async(site, ["sh", "-c", "(sleep 5) & yes"])
        done = await hostproc.run_async(site, ["sh", "-c", "cat; echo err >&2"], input=b"y" * 500)
        assert (done.returncode, done.stdout, done.stderr) == (0, b"y" * 500, b"err\n")

    anyio.run(main)
