"""Two kernels, one workspace, the real Slurm cluster: one launch is one Slurm job (issue 12, defect 2).

Before, a kernel on another state dir with the same workspace globs re-enrolled the channel and answered the same
sleep as the first: two Slurm jobs ran for one launch. Now the second kernel refuses a channel another store
owns, so the cluster sees exactly one job carrying the workspace's key in its comment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kernelproc import Kernel

from channel.paths import workspace_key

pytestmark = [pytest.mark.slurm, pytest.mark.bwrap]

CONFIG = """backend = "slurm"
jail = "bwrap"
rescan_seconds = 0.5
[slurm]
poll_seconds = 1.0
poll_max_seconds = 2.0
setup_slack_minutes = 1
warn_seconds = 60
exit_grace_seconds = 2
client_timeout_seconds = 10
"""


def git_workspace(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "README").write_text("one launch\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
            cwd=path,
            check=True,
            capture_output=True,
        )
    return path


def jobs_for(conf: Path, key: str) -> list[str]:
    """Job ids (live and recently ended) whose `--comment` names workspace `key`."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i|%k"],
        env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return [line.split("|", 1)[0] for line in out.stdout.splitlines() if f"ws={key} " in line]


def test_two_kernels_with_the_same_globs_submit_one_slurm_job_for_one_launch(
    tmp_path: Path, slurm_conf: Path, bwrap_available: None
) -> None:
    spaces = tmp_path / "spaces"
    ws = git_workspace(spaces / "a")
    key = workspace_key(str(ws.resolve()))
    extra = f'workspaces = ["{spaces}/*"]\n{CONFIG}'
    first = Kernel(tmp_path, extra, name="first")
    second = Kernel(tmp_path, extra, name="second")
    env = {"SLURM_CONF": str(slurm_conf)}
    try:
        first.start(env=env)
        first.wait_log("event=enrolled", 30)
        second.start(env=env)
        second.wait_log("event=enroll_refused", 30)
        tool = [sys.executable, str(ws / ".syscall" / "syscall")]
        staged = subprocess.run(
            [*tool, "launch", "--name", "once", "--", "echo", "ran"], cwd=ws, capture_output=True, text=True
        )
        assert staged.returncode == 0, staged.stderr
        done = subprocess.run(
            [*tool, "sleep", "--wait", "--json", "--timeout", "120"],
            cwd=ws,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        wake = json.loads(done.stdout)
        assert [t["state"] for t in wake["tasks"]] == ["COMPLETED"]
        # A negative needs a bound: several of the second kernel's rescans (0.5 s each) to act on the channel.
        time.sleep(3)
        assert len(jobs_for(slurm_conf, key)) == 1, "two kernels submitted the same launch"
        assert json.loads(second.cli("status", "--json").stdout)["workspaces"] == []
        assert first.stop() == 0
        assert second.stop() == 0
    finally:
        first.ensure_stopped()
        second.ensure_stopped()
