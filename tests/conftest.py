"""Shared test configuration.

Tests that need a real component (bubblewrap, the throwaway Slurm cluster) carry the `bwrap` or `slurm` marker
and call `need(...)`. Outside CI a missing component skips the test; with `CI=true` it fails it, because CI must
exercise the real thing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testenv import IN_CI, ROOT, need, python38

from kernel.io import stepguard

__all__ = ["IN_CI", "ROOT", "need"]


def bwrap_works() -> tuple[bool, str]:
    exe = shutil.which("bwrap")
    if exe is None:
        return False, "bwrap is not installed (apt-get install bubblewrap)"
    probe = subprocess.run(
        [exe, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {probe.stderr.strip()}"
    return True, ""


@pytest.fixture(scope="session")
def bwrap_available() -> None:
    ok, why = bwrap_works()
    need("bubblewrap", ok, why)


@pytest.fixture(scope="session")
def slurm_conf() -> Path:
    """The SLURM_CONF of the throwaway cluster that `./dev test` started."""
    conf = os.environ.get("SLURM_CONF")
    ok = bool(conf) and Path(conf or "").is_file() and shutil.which("sbatch") is not None
    need("slurm", ok, "no throwaway cluster is running (run the tests through ./dev test)")
    return Path(conf or "")


# Every store step of an in-process service in these tests runs under the guard: a filesystem call it makes
# fails the call and the test (kernel.io.stepguard).
stepguard.install()


@pytest.fixture(scope="session")
def py38() -> str:
    """The oldest Python the tool supports (3.8), for the MCP server's tests; CI must have it."""
    exe, why = python38()
    if exe is None:
        if IN_CI:
            pytest.fail(f"{why} (CI=true: the MCP server must be tested on the tool's oldest Python, 3.8)")
        pytest.skip(why)
    return exe


@pytest.fixture(autouse=True)
def no_file_calls_in_store_steps() -> Iterator[None]:
    stepguard.clear()
    yield
    found = stepguard.found()
    stepguard.clear()
    assert not found, "store steps touched the filesystem (they hold the store's lock):\n" + "\n".join(found)
