"""End to end on the Slurm backend: the installed tool, a real kernel process, the throwaway cluster, bwrap.

The same executor as on the local backend, with `backend = "slurm"` in the config: a 2-task array that writes an
artifact and a launch that fails, one sleep, one wake.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kernelproc import Kernel

pytestmark = [pytest.mark.slurm, pytest.mark.bwrap]


def test_a_sleep_runs_on_slurm_and_wakes_with_its_results(
    tmp_path: Path, slurm_conf: Path, bwrap_available: None
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], cwd=ws, check=True)
    (ws / "t.sh").write_text('echo "task $SWEEP_INDEX"; mkdir -p out; echo "made $SWEEP_INDEX" > out/a.txt\n')
    subprocess.run([*git, "add", "-A"], cwd=ws, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=ws, check=True)
    kernel = Kernel(tmp_path, 'backend = "slurm"\njail = "bwrap"\n[slurm]\npoll_seconds = 1.0\n')
    kernel.enroll(ws)

    def tool(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(ws / ".syscall" / "syscall"), *args],
            cwd=ws,
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{kernel.log_text()[-2000:]}"
        return done.stdout

    try:
        kernel.start(env={"SLURM_CONF": str(slurm_conf)})
        tool("launch", "--name", "sweep", "--array", "2", "--artifact", "out/a.txt", "--", "sh", "t.sh")
        tool("launch", "--name", "bad", "--", "sh", "-c", "echo no >&2; exit 3")
        wake = json.loads(tool("sleep", "--wait", "--json", "--timeout", "180"))
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    assert [(t["launch"], t["task"], t["state"], t["exit_code"]) for t in wake["tasks"]] == [
        ("sweep", 0, "COMPLETED", 0),
        ("sweep", 1, "COMPLETED", 0),
        ("bad", 0, "FAILED", 3),
    ]
    assert all(t["job_id"] for t in wake["tasks"])
    for t in wake["tasks"][:2]:
        assert t["stdout_tail"] == f"task {t['task']}\n"
        [art] = t["artifacts"]
        assert (ws / ".syscall" / art["delivered"]).read_text() == f"made {t['task']}\n"
    assert wake["tasks"][2]["stderr_tail"] == "no\n"
