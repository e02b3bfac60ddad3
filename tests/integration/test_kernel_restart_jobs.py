"""Stopping the kernel never stops jobs: a local-backend job running when the kernel is stopped (SIGTERM to the
kernel alone, which is what the unit's KillMode=process does) goes on running, and the next kernel adopts it
and delivers its wake.

No systemd is needed: the unit's two promises are played by hand. KillMode=process sends SIGTERM to the main
process only; the unit's `Environment=TMPDIR=` (a CacheDirectory=) is where the job's scratch must live, because
systemd empties the unit's PrivateTmp= when the kernel stops, under a job that is still running.
`jail = "none"`: the job waits on a file outside its tree (the jail has its own tests).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
from kernelproc import Kernel, git_workspace, put_request, read_answer, wait_for
from testenv import scratch_gone

from channel.paths import workspace_key
from kernel.backends.local import PID_FILE, PidRecord


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_job_runs_across_a_kernel_restart_and_its_wake_comes_from_the_next_kernel(tmp_path: Path) -> None:
    kernel = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\n')
    ws = git_workspace(tmp_path / "ws")
    marks = tmp_path / "marks"
    marks.mkdir()
    scratch = tmp_path / "cache"  # the unit's CacheDirectory=, given to the kernel as TMPDIR
    scratch.mkdir()
    kernel.enroll(ws, "--launches", "5", "--sleeps", "5")
    command = (
        f"pwd > {marks}/where; echo $$ > {marks}/pid; "
        f"while [ ! -e {marks}/go ]; do sleep 0.05; done; echo done; echo made > out.txt"
    )
    request = {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "launches": [{"name": "long", "command": command, "minutes": 10, "artifacts": ["out.txt"]}],
    }
    env = {"TMPDIR": str(scratch)}
    try:
        first = kernel.start(env=env)
        put_request(ws, "s1", request)
        assert wait_for(lambda: read_answer(ws, "s1"), 30, "the answer")["type"] == "accepted"
        where = wait_for(lambda: (marks / "where").exists() and (marks / "where").read_text(), 30, "the job")
        # The job's tree is in the kernel's TMPDIR (the unit's CacheDirectory=), not in a private /tmp.
        assert Path(where.strip()).is_relative_to(scratch), where
        task_dir = kernel.state / "runs" / workspace_key(ws.resolve()) / "1" / "long"
        rec = msgspec.json.decode((task_dir / PID_FILE).read_bytes(), type=PidRecord)
        assert rec.pid is not None
        # The job writes `where`, then `pid`: wait for the pid itself (the shell creates the file before it
        # writes it).
        job = int(
            wait_for(lambda: (marks / "pid").exists() and (marks / "pid").read_text().strip(), 30, "pid")
        )
        wrapper = rec.pid
        # Its own session: signals to the kernel's process group (a terminal's Ctrl-C) never reach it.
        assert os.getsid(wrapper) == wrapper != os.getsid(first.pid)

        assert kernel.stop() == 0  # SIGTERM to the kernel alone: KillMode=process
        assert alive(wrapper), "stopping the kernel stopped the job's wrapper"
        assert alive(job), "stopping the kernel stopped the job"
        assert not (ws / ".syscall" / "wakes" / "s1.json").exists()
        log_before = len(kernel.log_text())

        kernel.start(env=env)
        assert alive(wrapper)
        assert alive(job)
        (marks / "go").touch()
        wake_file = ws / ".syscall" / "wakes" / "s1.json"
        wait_for(wake_file.exists, 30, "the wake from the restarted kernel")
        kernel.wait_log("event=woken", 10)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        (marks / "go").touch()

    wake = json.loads(wake_file.read_bytes())
    [task] = wake["tasks"]
    assert (task["state"], task["exit_code"], task["stdout_tail"]) == ("COMPLETED", 0, "done\n")
    [art] = task["artifacts"]
    assert (ws / ".syscall" / art["delivered"]).read_bytes() == b"made\n"
    after = kernel.log_text()[log_before:]
    for event in ("event=task_ended", "event=woken"):
        assert event in after, f"{event}: the wake did not come from the next kernel"
    scratch_gone(scratch)
