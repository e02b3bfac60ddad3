"""Fixtures for the `syscall` tool's tests: the interpreters it must run on, a workspace with a fake kernel.

The tool runs in sandboxes with whatever Python they have, so its CLI tests run it under this venv's Python AND
under the oldest Python >= 3.8 found in pyenv's versions directory. With CI=true a missing old Python fails the
run. The versions actually used are printed in the terminal summary.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tool_fake_kernel import FakeKernel, assert_requests_valid

IN_CI = os.environ.get("CI", "").lower() == "true"
PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"
OLDEST_SUPPORTED = (3, 8)
USED: dict[str, str] = {}  # interpreter path -> its version, for the summary


def oldest_python() -> Path | None:
    """The oldest CPython >= 3.8 under pyenv's versions directory, or None."""
    found: list[tuple[tuple[int, ...], Path]] = []
    if PYENV_VERSIONS.is_dir():
        for d in PYENV_VERSIONS.iterdir():
            m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", d.name)
            exe = d / "bin" / "python3"
            if m and exe.is_file():
                version = tuple(int(x) for x in m.groups())
                if version[:2] >= OLDEST_SUPPORTED:
                    found.append((version, exe))
    return min(found)[1] if found else None


def _version_of(exe: str) -> str:
    out = subprocess.run(
        [exe, "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="session", params=["venv", "oldest"])
def python(request: pytest.FixtureRequest) -> str:
    """An interpreter to run the tool with: this venv's, then the oldest supported one on the machine."""
    if request.param == "venv":
        exe = sys.executable
    else:
        old = oldest_python()
        if old is None:
            message = f"no Python >= 3.8 under {PYENV_VERSIONS}"
            if IN_CI:
                pytest.fail(f"{message} (CI=true: the tool must be tested on its oldest supported Python)")
            pytest.skip(message)
        exe = str(old)
    USED[exe] = _version_of(exe)
    return exe


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[FakeKernel]:
    """A fake kernel answering a fresh workspace; on teardown every request it saw is checked valid."""
    fk = FakeKernel(tmp_path / "ws")
    with fk.running():
        yield fk
    assert_requests_valid(fk)


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """An unrelated cwd (with a decoy channel) to run the tool from: it must never use the cwd."""
    d = tmp_path / "elsewhere"
    (d / ".syscall").mkdir(parents=True)
    (d / ".syscall" / "kernel.json").write_text("{not json")
    return d


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if USED:
        versions = ", ".join(f"{v} ({exe})" for exe, v in sorted(USED.items(), key=lambda kv: kv[1]))
        terminalreporter.write_line(f"syscall tool tested under Python {versions}")
