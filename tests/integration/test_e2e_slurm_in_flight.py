"""End to end on the real Slurm cluster: two sleeps in flight at once (issue 25).

One kernel (`backend = "slurm"`, bwrap), one workspace, the installed tool. The first sleep's job runs far longer
than the test (it is cancelled by the test, by its sleep's id); the second is committed while the first is in
flight and is its own Slurm job, with its own wake, which comes while the first still runs. Then `cancel --sleep`
stops the first, its wake reports it CANCELLED, and the budget is exact: two sleeps and two launches charged,
nothing left reserved.

The module needs the throwaway cluster that `./dev test` starts (`scripts/slurm-cluster`, SLURM_CONF).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, run_tool, wait_for

from channel.paths import workspace_key

pytestmark = [pytest.mark.slurm, pytest.mark.bwrap]

CONFIG = """backend = "slurm"
jail = "bwrap"
rescan_seconds = 2
[slurm]
poll_seconds = 1.0
poll_max_seconds = 2.0
setup_slack_minutes = 1
warn_seconds = 60
exit_grace_seconds = 2
client_timeout_seconds = 10
"""


def squeue_jobs(conf: Path, key: str) -> dict[str, str]:
    """Job id -> state of the cluster's jobs (live and recently ended) whose `--comment` names workspace `key`."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i|%T|%k"],
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split("|", 2) for line in out.stdout.splitlines()]
    return {job: state for job, state, comment in rows if f"ws={key} " in comment}


def test_two_sleeps_in_flight_on_slurm(tmp_path: Path, slurm_conf: Path, bwrap_available: None) -> None:
    kernel = Kernel(tmp_path, CONFIG)
    ws = make_workspace(tmp_path / "ws")
    kernel.enroll(ws, "--launches", "10", "--sleeps", "10", "--gpu-hours", "1")
    kernel.start(env={"SLURM_CONF": str(slurm_conf)})
    key = workspace_key(ws.resolve())

    def ok(*args: str, timeout: float = 180) -> str:
        done = run_tool(ws, *args, timeout=timeout)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{kernel.log_text()[-3000:]}"
        return done.stdout

    def accepted() -> dict[str, Any]:
        ans: dict[str, Any] = json.loads(ok("sleep", "--json"))
        assert ans["type"] == "accepted", ans
        assert all(j["job_id"] for j in ans["jobs"]), ans
        return ans

    try:
        ok("launch", "--name", "long", "--minutes", "30", "--", "sh", "-c", "echo long-started; sleep 3600")
        a = accepted()
        ok("launch", "--name", "short", "--minutes", "5", "--", "sh", "-c", "echo short-done")
        b = accepted()  # while `a` is in flight
        [a_job] = [j["job_id"] for j in a["jobs"]]
        [b_job] = [j["job_id"] for j in b["jobs"]]
        assert a_job != b_job
        assert {a_job, b_job} <= set(squeue_jobs(slurm_conf, key)), "each sleep is its own Slurm job"
        assert (b["budget"]["sleeps"], b["budget"]["launches"]) == (8, 8)

        # `b` wakes while `a` still runs: `wait` shows the first wake, and says whose is not shown yet
        shown = ok("wait", "--timeout", "150", timeout=180)
        assert f"wakes/{b['id']}.md" in shown, shown
        assert f"Not shown yet: the wake of your sleep {a['id']};" in shown
        wake_b = json.loads((ws / ".syscall" / "wakes" / f"{b['id']}.json").read_bytes())
        assert [(t["launch"], t["state"], t["job_id"]) for t in wake_b["tasks"]] == [
            ("short", "COMPLETED", b_job)
        ]
        assert squeue_jobs(slurm_conf, key).get(a_job) in ("PENDING", "RUNNING")
        status = json.loads(ok("status", "--json"))["answer"]
        assert [s["id"] for s in status["in_flight"]] == [a["id"]]

        # the first is cancelled by its id; its wake comes, the budget is exact
        wait_for(lambda: "long-started" in ok("tail", "long"), 120, "the long job's first line", step=0.5)
        ok("cancel", "--sleep", a["id"])
        wake_a = json.loads(ok("wait", "--json", "--timeout", "150", timeout=180))
        assert wake_a["id"] == a["id"]
        assert [(t["launch"], t["state"]) for t in wake_a["tasks"]] == [("long", "CANCELLED")]
        final = json.loads(ok("budget", "--json"))["budget"]
        assert (final["sleeps"], final["launches"], final["reserved_gpu_hours"]) == (8, 8, 0)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
