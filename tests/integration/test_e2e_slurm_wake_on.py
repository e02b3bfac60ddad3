"""End to end on the real Slurm cluster: a sleep with `--wake-on first-failure` (issue 25).

One kernel (`backend = "slurm"`, bwrap), one workspace, the installed tool. A sweep of two Slurm array tasks: one
fails at once, the other runs far longer than the test waits for its early wake. The early wake comes while the
other still runs on the cluster and lists it; `status` says the sleep woke early; `cancel --sleep` then stops the
task left running, and the rest wake delivers it CANCELLED; the budget is exact: one sleep and one launch
charged, nothing left reserved.

The module needs the throwaway cluster that `./dev test` starts (`scripts/slurm-cluster`, SLURM_CONF).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kernelproc import Kernel, make_workspace, run_tool, wait_for
from test_e2e_slurm_in_flight import CONFIG

pytestmark = [pytest.mark.slurm, pytest.mark.bwrap]

WORK = 'case "$SWEEP_MODE" in fail) echo boom >&2; exit 3;; *) echo slow-started; sleep 3600;; esac\n'


def test_first_failure_wakes_early_on_slurm(tmp_path: Path, slurm_conf: Path, bwrap_available: None) -> None:
    kernel = Kernel(tmp_path, CONFIG)
    ws = make_workspace(tmp_path / "ws", {"work.sh": WORK})
    kernel.enroll(ws, "--launches", "10", "--sleeps", "10", "--gpu-hours", "1")
    kernel.start(env={"SLURM_CONF": str(slurm_conf)})

    def ok(*args: str, timeout: float = 240) -> str:
        done = run_tool(ws, *args, timeout=timeout)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{kernel.log_text()[-3000:]}"
        return done.stdout

    try:
        ok("launch", "--name", "grid", "--minutes", "30", "--sweep", "mode=fail,slow", "--", "sh", "work.sh")
        early = json.loads(ok("sleep", "--wake-on", "first-failure", "--wait", "--json", "--timeout", "200"))
        sid = early["id"]
        assert early["part"] == "early"
        assert (early["tasks"][0]["task"], early["tasks"][0]["state"]) == (0, "FAILED")
        assert early["tasks"][1]["state"] in ("PENDING", "RUNNING")
        assert early["tasks"][1]["job_id"]  # a Slurm array task, still on the cluster
        assert [r["task"] for r in early["rest_tasks"]] == [1]
        assert not (ws / ".syscall" / "wakes" / f"{sid}.rest.json").exists()
        assert "woke early at" in ok("status")

        cancelled = ok("cancel", "--sleep", sid)
        assert "its rest wake (wakes/" in cancelled
        rest_md = ok("wait", sid, "--timeout", "200")
        assert f"# Rest of sleep {sid}" in rest_md
        rest = json.loads((ws / ".syscall" / "wakes" / f"{sid}.rest.json").read_bytes())
        assert [(t["task"], t["state"]) for t in rest["tasks"]] == [(0, "FAILED"), (1, "CANCELLED")]
        budget = json.loads(ok("budget", "--json"))["budget"]
        assert (budget["launches"], budget["sleeps"], budget["reserved_gpu_hours"]) == (9, 9, 0)
        wait_for(lambda: "event=woken " in kernel.log_text(), 30, "woken")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
