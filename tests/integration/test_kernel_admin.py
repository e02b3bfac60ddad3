"""The operator's verbs against a running kernel (issue 12, defect 10): per-workspace policy at enrollment,
budget changes recorded with who and when, pause/resume, unenroll (records kept)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kernelproc import Kernel, git_workspace, put_request, read_answer, status, wait_answer, wait_for

from channel.paths import workspace_key


def kernel_json(ws: Path) -> dict[str, object]:
    return json.loads((ws / ".syscall" / "kernel.json").read_text())  # type: ignore[no-any-return]


def test_policy_budget_pause_and_unenroll(tmp_path: Path) -> None:
    k = Kernel(
        tmp_path, 'backend = "none"\npoll_seconds = 0.1\nrescan_seconds = 0.5\n[defaults]\nlaunches = 10\n'
    )
    ws = git_workspace(tmp_path / "ws")
    key = workspace_key(str(ws.resolve()))

    # Per-workspace policy at enrollment, checked, published, and kept by later enrollments.
    bad = k.cli("enroll", str(ws), "--max-gpus", "99", check=False)
    assert bad.returncode == 1
    assert "--max-gpus must be an integer from 0 to 64, got 99" in bad.stderr
    bad = k.cli("enroll", str(ws), "--max-mem-mb", "8", check=False)
    assert bad.returncode == 1
    assert "--max-mem-mb must be an integer from 16 to 4194304, got 8" in bad.stderr
    bad = k.cli("enroll", str(ws), "--max-cpus", "0", check=False)
    assert "--max-cpus must be an integer from 1 to 1024, got 0" in bad.stderr
    k.enroll(
        ws, "--max-minutes", "20", "--max-gpus", "2", "--network", "--max-mem-mb", "2048", "--max-cpus", "4"
    )
    k.enroll(ws)
    policy = kernel_json(ws)["policy"]
    assert (policy["max_minutes"], policy["max_gpus"], policy["network"]) == (20, 2, True)  # type: ignore[index]
    assert (policy["max_mem_mb"], policy["max_cpus"]) == (2048, 4)  # type: ignore[index]
    limits = kernel_json(ws)["limits"]
    assert (limits["mem_mb_min"], limits["mem_mb_ceiling"], limits["cpus_ceiling"]) == (16, 4194304, 1024)  # type: ignore[index]
    k.start()
    try:
        assert kernel_json(ws)["policy"]["max_minutes"] == 20  # type: ignore[index]

        # Budget changes, recorded with who and when.
        out = k.cli(
            "budget", str(ws), "--add-launches", "5", "--set-sleeps", "3", "--add-gpu-hours", "1.5"
        ).stdout
        assert "now: 15 launches, 3 sleeps" in out
        refused = k.cli("budget", str(ws), "--add-launches", "-1000", check=False)
        assert refused.returncode == 1
        assert "below zero" in refused.stderr
        # The running kernel rewrites budget.json (in its own order), within a few poll intervals.
        assert "the running kernel (pid" in out
        wait_for(
            lambda: (
                (b := json.loads((ws / ".syscall" / "budget.json").read_text())["budget"])["launches"] == 15
                and b["sleeps"] == 3
            ),
            5,
            "budget.json showing the change",
        )
        [change] = [json.loads(line) for line in k.cli("history", "--budget", "--json").stdout.splitlines()]
        assert change["workspace"] == key
        assert change["change"] == "launches +5, gpu_hours +1.5, sleeps = 3"
        assert change["who"]
        assert change["before"]["launches"] == 10
        assert change["after"]["launches"] == 15
        assert "by " in k.cli("history", "--budget", str(ws)).stdout
        # The running kernel answers with the new budget.
        put_request(ws, "s0", status("s0"))
        assert wait_answer(ws, "s0")["budget"]["launches"] == 15

        # Pause: requests wait; status says so; resume answers them.
        assert "is paused" in k.cli("pause", str(ws)).stdout
        k.wait_log(f"event=paused ws={key}", 10)
        put_request(ws, "s1", status("s1"))
        time.sleep(1.5)  # a negative needs a bound: three rescans
        assert read_answer(ws, "s1") is None
        assert "PAUSED since" in k.cli("status").stdout
        assert json.loads(k.cli("status", "--json").stdout)["workspaces"][0]["paused_at"]
        k.cli("resume", str(ws))
        k.wait_log(f"event=resumed ws={key}", 10)
        wait_answer(ws, "s1")

        # Unenroll: the channel goes, the records stay, the kernel stops serving it (and stays up).
        out = k.cli("unenroll", str(ws)).stdout
        assert "unenrolled" in out
        assert not (ws / ".syscall").exists()
        assert json.loads(k.cli("status", "--json").stdout)["workspaces"] == []
        assert "not an enrolled workspace" in k.cli("pause", str(ws), check=False).stderr
        # Enrolled again: the same budget and history.
        again = k.cli("enroll", str(ws), check=False)
        assert again.returncode == 0, again.stderr
        put_request(ws, "s2", status("s2"))
        assert wait_answer(ws, "s2")["budget"]["launches"] == 15
        assert k.proc is not None
        assert k.proc.poll() is None
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def unenroll_kernel(tmp_path: Path) -> tuple[Kernel, Path]:
    k = Kernel(
        tmp_path, 'jail = "none"\npoll_seconds = 0.1\nrescan_seconds = 0.5\n[environment]\nmode = "none"\n'
    )
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    return k, ws


def start_long_job(ws: Path, pid_file: Path) -> int:
    """A sleep whose one job runs for ten minutes (it writes its pid); the job's pid once it runs."""
    request = {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "launches": [
            {"name": "long", "command": f"echo $$ > {pid_file}; exec sleep 600", "artifacts": ["out.txt"]}
        ],
    }
    put_request(ws, "s1", request)
    assert wait_answer(ws, "s1", timeout=30)["type"] == "accepted"
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the job to start")
    return int(pid_file.read_text())


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_unenroll_force_cancels_the_sleep_in_flight_and_leaves_nothing_waiting(tmp_path: Path) -> None:
    """Issue 24: `unenroll --force` with a sleep in flight left its job running, the sleep live for ever
    (`status`: "0 workspaces, 1 sleeps in flight") and `gather_deferred` logged at every start. Now the kernel
    cancels its jobs and ends the sleep (recorded, its wake kept in the store, nothing written into the channel
    that is gone), and a restart finds nothing left to do."""
    k, ws = unenroll_kernel(tmp_path)
    k.start()
    try:
        job = start_long_job(ws, tmp_path / "job.pid")
        refused = k.cli("unenroll", str(ws), check=False)
        assert refused.returncode == 1
        assert "--force (its jobs are cancelled)" in refused.stderr
        out = k.cli("unenroll", str(ws), "--force").stdout
        assert f"the running kernel (pid {k.proc.pid if k.proc else 0}) cancels its jobs" in out, out

        wait_for(lambda: gone(job), 30, "the job to be killed")
        wait_for(
            lambda: json.loads(k.cli("status", "--json").stdout)["live_sleeps"] == 0, 30, "the sleep to end"
        )
        assert "0 workspaces, 0 sleeps and 0 jobs in flight" in k.cli("status").stdout
        k.wait_log("event=wake_not_written", 10)
        assert k.stop() == 0
        [line] = [x for x in k.cli("history", str(ws)).stdout.splitlines() if x.startswith("  seq 1 ")]
        assert " woken " in line, line
        assert "1 CANCELLED" in line, line
        # Nothing waits for the channel that is gone, now or at the next start.
        k.start()
        k.wait_log("event=backend_recovered", 10, count=2)
        time.sleep(1.5)  # a negative needs a bound: a tick and more
        assert k.stop() == 0
        assert "gather_deferred" not in k.log_text()
        assert "wake_deferred" not in k.log_text()
        assert not (ws / ".syscall").exists()
    finally:
        k.ensure_stopped()


def test_unenroll_force_with_no_kernel_running_is_cancelled_by_the_next_start(tmp_path: Path) -> None:
    k, ws = unenroll_kernel(tmp_path)
    k.start()
    try:
        job = start_long_job(ws, tmp_path / "job.pid")
        assert k.stop() == 0  # the job runs on (its own session)
        assert not gone(job)
        out = k.cli("unenroll", str(ws), "--force").stdout
        assert "no kernel runs on this state dir: the next `serve` cancels its jobs" in out, out
        time.sleep(1)
        assert not gone(job)  # nothing else stops it: the message says so
        k.start()
        wait_for(lambda: gone(job), 30, "the next kernel to kill the job")
        wait_for(
            lambda: json.loads(k.cli("status", "--json").stdout)["live_sleeps"] == 0, 30, "the sleep to end"
        )
        k.wait_log("event=unenrolled_sleep_cancelled", 10)
        assert k.stop() == 0
        assert "gather_deferred" not in k.log_text()
    finally:
        k.ensure_stopped()
