"""The built wheel holds every package of the tree (an editable install hides a missing one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from channel import release
from tests.testenv import ROOT as REPO


def head() -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def build_wheel(src: Path, out: Path, env: dict[str, str] | None = None) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(out)],
        check=True,
        capture_output=True,
        env=env,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def built_release(wheel: Path) -> tuple[str, str]:
    """(VERSION, COMMIT) as setuptools-scm wrote them into the wheel's channel/_version.py."""
    text = zipfile.ZipFile(wheel).read("channel/_version.py").decode()
    found = dict(re.findall(r"^(VERSION|COMMIT) = '([^']*)'$", text, re.M))
    return found["VERSION"], found["COMMIT"]


@pytest.mark.slow
def test_a_fresh_clone_builds_a_version_naming_its_commit(tmp_path: Path) -> None:
    """Every commit was version 0.1.0: `pip install new.whl` over an old install kept the old code. The version
    comes from git: a clone builds one that names its commit, and a later commit builds a greater one."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETUPTOOLS_SCM_")}
    version, commit = built_release(build_wheel(clone, tmp_path / "a", env))
    assert (
        commit
        == "g"
        + subprocess.run(
            ["git", "-C", str(clone), "rev-parse", "--short=9", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    assert commit in version, version
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "next"], check=True, capture_output=True)
    later, _ = built_release(build_wheel(clone, tmp_path / "b", env))
    assert Version(later) > Version(version), (later, version)


@pytest.mark.slow
def test_wheel_holds_every_package(tmp_path: Path) -> None:
    # Built from a clean copy: setuptools reuses an in-tree build/ directory, which would hide a missing package.
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache"),
    )
    # the copy has no .git: the version and commit are passed in, as ./dev's wheel check does
    env = os.environ | {
        "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SYSCALL_KERNEL": release.VERSION,
        "SETUPTOOLS_SCM_PRETEND_METADATA_FOR_SYSCALL_KERNEL": f'{{node="g{head()}"}}',
    }
    wheel = build_wheel(src, tmp_path, env)
    assert built_release(wheel) == (release.VERSION, f"g{head()}")
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
