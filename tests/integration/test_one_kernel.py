"""One kernel per state dir, and one store per channel (issue 12, defect 2).

A second `serve` on the same state dir exits 2 naming the holder's pid (it used to crash the first with an
IntegrityError). A kernel on ANOTHER state dir with the same workspace globs does not take the channels over (it
used to re-enroll them, reset their budgets and answer the same sleep: two jobs for one launch) until the operator
says `enroll --take-over`; the first kernel then stops serving the channel at its next rescan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kernelproc import ROOT, Kernel, wait_for

from channel.paths import workspace_key


def git_workspace(path: Path) -> Path:
    path.mkdir(parents=True)
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "init"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
            cwd=path,
            check=True,
            capture_output=True,
        )
    return path


def tool(ws: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ws / ".syscall" / "syscall"), *args],
        cwd=ws,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
    return done.stdout


def launch_and_wait(ws: Path, counter: Path, name: str) -> dict[str, object]:
    tool(ws, "launch", "--name", name, "--", "sh", "-c", f"echo {name} >> {counter}")
    return json.loads(tool(ws, "sleep", "--wait", "--json", "--timeout", "60"))  # type: ignore[no-any-return]


def test_a_second_serve_on_the_same_state_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\nrescan_seconds = 0.5\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.start()
    try:
        assert k.proc is not None
        second = subprocess.run(
            [sys.executable, "-m", "kernel.cli", "serve", "--config", str(k.config)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2, second.stderr
        assert f"state dir held by pid {k.proc.pid}" in second.stderr
        # The first kernel is unharmed and still answers; `status` sees it alive.
        tool(ws, "status")
        alive = json.loads(k.cli("status", "--json").stdout)
        assert alive["kernel_pid"] == k.proc.pid
        assert f"kernel: running (pid {k.proc.pid})" in k.cli("status").stdout
        assert k.proc.poll() is None
        assert "Error" not in k.log_text()
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
    assert json.loads(k.cli("status", "--json").stdout)["kernel_pid"] is None
    assert "kernel: NOT running" in k.cli("status").stdout
    # Once it is gone the state dir is free again (the lock went with the process).
    k.start(wait_ready=False)
    try:
        k.wait_log("event=ready", 60, count=2)
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_a_kernel_on_another_state_dir_never_answers_a_channel_it_does_not_own(tmp_path: Path) -> None:
    spaces = tmp_path / "spaces"
    ws = git_workspace(spaces / "a")
    counter = tmp_path / "runs.txt"
    extra = f'workspaces = ["{spaces}/*"]\njail = "none"\nrescan_seconds = 0.5\n'
    first = Kernel(tmp_path, extra, name="first")
    second = Kernel(tmp_path, extra, name="second")
    try:
        first.start()
        first.wait_log("event=enrolled", 10)
        first.cli("enroll", str(ws), "--launches", "7")
        second.start()
        second.wait_log("event=enroll_refused", 10)
        assert "owned by another kernel's store" in second.log_text()

        wake = launch_and_wait(ws, counter, "one")
        assert wake["seq"] == 1
        wait_for(lambda: counter.exists(), 10, "the job's line")
        # A negative needs a bound: three of the second kernel's rescans (0.5 s each) to act on the channel.
        time.sleep(1.5)
        status2 = json.loads(second.cli("status", "--json").stdout)
        assert status2["workspaces"] == []
        assert counter.read_text() == "one\n"
        # The first kernel's budget is untouched by the second kernel's defaults.
        status1 = json.loads(first.cli("status", "--json").stdout)
        assert status1["workspaces"][0]["budget"]["launches"] == 6

        # The operator moves the channel: the second kernel takes it over, the first lets it go.
        out = second.cli("enroll", str(ws), "--take-over").stdout
        assert "taken over from store" in out
        first.wait_log("event=channel_owned_elsewhere", 10)
        launch_and_wait(ws, counter, "two")
        wait_for(lambda: counter.read_text().count("\n") >= 2, 10, "the second job's line")
        assert counter.read_text() == "one\ntwo\n"
        key = workspace_key(str(ws.resolve()))
        assert sorted(os.listdir(first.state / "runs" / key)) == ["1"]
        assert sorted(os.listdir(second.state / "runs" / key)) == ["1"]
        status1 = json.loads(first.cli("status", "--json").stdout)
        assert "owned by another kernel's store" in status1["workspaces"][0]["problem"]
        # Without --take-over the first kernel's operator cannot take it back by accident.
        back = first.cli("enroll", str(ws), check=False)
        assert back.returncode == 1
        assert "enroll --take-over" in back.stderr
        assert first.stop() == 0
        assert second.stop() == 0
    finally:
        first.ensure_stopped()
        second.ensure_stopped()
