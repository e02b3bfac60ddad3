"""docs/operator.md's quick start runs as written: its fenced block is extracted and run by bash, with `$HOME` a
temporary directory, so the operator's first commands cannot drift from the kernel.

The one change: run as root (CI containers), `allow_root = true` is added to the config the block writes,
because `serve` and `check` refuse root otherwise (as the guide says). The account has no git identity (issue
24: the block must not need one).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from testenv import ROOT

pytestmark = pytest.mark.bwrap


def quickstart_block() -> str:
    text = (ROOT / "docs" / "operator.md").read_text()
    section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, re.M | re.S)
    assert len(blocks) == 1, "the quick start has exactly one ```sh block"
    return str(blocks[0])


def test_the_quick_start_runs_as_written(tmp_path: Path, bwrap_available: None) -> None:
    script = quickstart_block()
    if os.geteuid() == 0:
        script, n = re.subn(r"^state_dir = ", "allow_root = true\nstate_dir = ", script, flags=re.M)
        assert n == 1
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "LANG": "C.UTF-8",
        # An account without a git identity: no ~/.gitconfig (HOME is empty), no GIT_* variable, and not the
        # system's config either (a machine's /etc/gitconfig may name one): the kernel and the tool need none.
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        env=env,
        cwd=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        # The block's kernel runs in the background: never leave it behind, whatever happened.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log = home / "kernel.log"
    detail = f"{out}\n--- kernel.log ---\n{log.read_text() if log.exists() else '(none)'}"
    assert proc.returncode == 0, detail
    assert "0 error(s)" in out, detail  # check
    assert "enrolled " in out, detail
    assert "hello from the job" in out, detail  # the wake, printed by sleep --wait
    assert "COMPLETED" in out, detail
    assert "kernel: running" in out, detail  # status while the kernel serves
    assert "budget of " in out, detail
    assert "now: 24 launches" in out, detail  # budget --add-launches 5 (20 granted, 1 used)
    assert re.search(r"by \S+: launches \+5 -> 24 launches", out), detail  # history --budget
    assert "event=stopped" in log.read_text(), detail  # it stopped cleanly on SIGTERM
