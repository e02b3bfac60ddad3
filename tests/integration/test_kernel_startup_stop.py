"""SIGTERM is honoured at any point of start-up: a kernel enrolling many new workspaces from its `workspaces`
glob stops within a step (one enrollment) instead of finishing them all first; the rest are enrolled at the next
start. Real kernel process, real git workspaces."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from kernelproc import Kernel

N = 100


def test_sigterm_during_first_enrollment_stops_within_a_step(tmp_path: Path) -> None:
    root = tmp_path / "spaces"
    root.mkdir()
    first = root / "w0000"
    subprocess.run(["git", "init", "-q", str(first)], check=True)
    for i in range(1, N):
        shutil.copytree(first, root / f"w{i:04d}", symlinks=True)
    kernel = Kernel(tmp_path, f'workspaces = ["{root}/*"]')
    kernel.start(wait_ready=False)
    kernel.wait_log("event=enrolled", 60, count=5)
    t0 = time.monotonic()
    rc = kernel.stop(timeout=60)
    took = time.monotonic() - t0
    log = kernel.log_text()
    assert rc == 0
    assert "event=ready" not in log, "start-up went on after SIGTERM"
    enrolled = log.count("event=enrolled")
    assert enrolled < N, f"every workspace was enrolled ({enrolled}) before SIGTERM was honoured"
    assert took < 10, f"SIGTERM took {took:.1f} s during start-up"

    kernel.start(wait_ready=False)  # the next start enrolls the rest (each enrollment runs git: allow for it)
    kernel.wait_log("event=ready", 300)
    assert kernel.log_text().count("event=enrolled") == N
    assert kernel.stop() == 0
