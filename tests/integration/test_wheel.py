"""The built wheel holds every package of the tree (an editable install hides a missing one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.testenv import ROOT as REPO


@pytest.mark.slow
def test_wheel_holds_every_package(tmp_path: Path) -> None:
    # Built from a clean copy: setuptools reuses an in-tree build/ directory, which would hide a missing package.
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            str(src),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    in_tree = {
        str(init.relative_to(REPO))
        for top in ("channel", "kernel", "tool", "spec")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert in_tree, "no packages found in the tree"
    missing = sorted(in_tree - names)
    assert not missing, f"the wheel lacks {missing}: list them in pyproject.toml's packages.find"
    assert "tool/syscall.py" in names
    # the conformance runner finds the protocol beside it in an installed wheel
    spec_files = {
        str(p.relative_to(REPO))
        for p in (REPO / "spec").rglob("*")
        if p.suffix in (".json", ".md") and p.is_file()
    }
    assert spec_files, "no spec data files found in the tree"
    missing = sorted(spec_files - names)
    assert not missing, f"the wheel lacks {missing}: list them in pyproject.toml's package-data"
    # the deployment files `syscall-kernel unit|example-config|dashboard` print: copies of deploy/'s, not links
    with zipfile.ZipFile(wheel) as z:
        for link in (REPO / "kernel" / "share").iterdir():
            name = f"kernel/share/{link.name}"
            assert name in names, f"the wheel lacks {name}: list it in pyproject.toml's package-data"
            assert z.read(name) == link.resolve().read_bytes(), name
