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

from kernelproc import (
    ROOT,
    Kernel,
    committed_workspace,
    put_request,
    read_answer,
    run_tool,
    status,
    wait_answer,
    wait_for,
)

from channel.paths import workspace_key


def tool(ws: Path, *args: str) -> str:
    done = run_tool(ws, *args, timeout=90)
    assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
    return done.stdout


def launch_and_wait(ws: Path, counter: Path, name: str) -> dict[str, object]:
    tool(ws, "launch", "--name", name, "--", "sh", "-c", f"echo {name} >> {counter}")
    return json.loads(tool(ws, "sleep", "--wait", "--json", "--timeout", "60"))  # type: ignore[no-any-return]


def test_a_second_serve_on_the_same_state_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\nrescan_seconds = 0.5\n')
    ws = committed_workspace(tmp_path / "ws")
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
    ws = committed_workspace(spaces / "a")
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
        # The refusal's advice, at its end, is logged whole (issue 24: it was cut at 200 characters).
        [refused] = [line for line in second.log_text().splitlines() if "event=enroll_refused" in line]
        assert f"enroll --take-over {ws.resolve()}" in refused, refused
        # `check` reports the glob's match that this kernel will not serve (issue 24: it counted it as fine).
        checked = second.cli("check", check=False).stdout
        [owned] = [line for line in checked.splitlines() if "owned by another kernel's store" in line]
        assert owned.startswith("warn    workspaces:"), checked
        assert f"matches {ws.resolve()}" in owned, owned

        wake = launch_and_wait(ws, counter, "one")
        assert wake["seq"] == 1
        first_result = sorted(p.relative_to(ws) for p in (ws / ".syscall" / "results" / "1").rglob("*"))
        assert first_result
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
        wake2 = launch_and_wait(ws, counter, "two")
        wait_for(lambda: counter.read_text().count("\n") >= 2, 10, "the second job's line")
        assert counter.read_text() == "one\ntwo\n"
        key = workspace_key(str(ws.resolve()))
        assert sorted(os.listdir(first.state / "runs" / key)) == ["1"]
        # The new store numbers after what the channel showed: the old store's results/1 is not overwritten.
        assert wake2["seq"] == 2
        assert sorted(os.listdir(second.state / "runs" / key)) == ["2"]
        assert (
            sorted(p.relative_to(ws) for p in (ws / ".syscall" / "results" / "1").rglob("*")) == first_result
        )
        assert (ws / ".syscall" / "results" / "2").is_dir()
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


def test_an_agent_that_deletes_the_owner_still_gets_one_kernel(tmp_path: Path) -> None:
    """kernel.json is the agent's to write: with its `owner` gone, a second kernel (another state dir, the same
    globs) still does not serve the channel, because the first holds the channel directory's lock."""
    spaces = tmp_path / "spaces"
    ws = committed_workspace(spaces / "a")
    counter = tmp_path / "runs.txt"
    extra = f'workspaces = ["{spaces}/*"]\njail = "none"\nrescan_seconds = 0.5\n'
    first = Kernel(tmp_path, extra, name="first")
    second = Kernel(tmp_path, extra, name="second")
    try:
        first.start()
        first.wait_log("event=enrolled", 10)
        kj = ws / ".syscall" / "kernel.json"
        before_budget = (ws / ".syscall" / "budget.json").read_bytes()
        info = json.loads(kj.read_bytes())
        del info["owner"]  # the hostile agent: no owner recorded any more
        kj.write_text(json.dumps(info))
        edited = kj.read_bytes()
        second.start()
        assert first.proc is not None
        second.wait_log("event=enroll_refused", 10)
        assert f"served by another kernel (pid {first.proc.pid})" in second.log_text()
        # Nothing of the second kernel was written into the channel.
        assert kj.read_bytes() == edited
        assert (ws / ".syscall" / "budget.json").read_bytes() == before_budget

        launch_and_wait(ws, counter, "one")
        wait_for(lambda: counter.exists(), 10, "the job's line")
        time.sleep(1.5)  # three of the second kernel's rescans
        assert counter.read_text() == "one\n"
        assert json.loads(second.cli("status", "--json").stdout)["workspaces"] == []
        # Nor does the second kernel's operator take it by a plain `enroll` (no owner to refuse it by).
        by_hand = second.cli("enroll", str(ws), check=False)
        assert by_hand.returncode == 1
        assert f"served by another kernel (pid {first.proc.pid})" in by_hand.stderr
        assert "enroll --take-over" in by_hand.stderr
        assert kj.read_bytes() == edited
        # This state dir's own kernel holding the lock is no obstacle to its operator.
        first.cli("enroll", str(ws), "--launches", "9")
        assert first.stop() == 0
        # Once the first kernel has let go, `enroll --take-over` moves the channel to the second.
        assert "taken over from store" in second.cli("enroll", str(ws), "--take-over").stdout
        wake = launch_and_wait(ws, counter, "two")
        assert wake["seq"] == 2
        wait_for(lambda: counter.read_text().count("\n") >= 2, 10, "the second job's line")
        assert counter.read_text() == "one\ntwo\n"
        assert second.stop() == 0
    finally:
        first.ensure_stopped()
        second.ensure_stopped()


LOCKER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_an_agent_that_locks_its_channel_loses_only_its_own_service(tmp_path: Path) -> None:
    """The agent can flock its channel directory too: then no kernel serves that channel, `status` says so
    truly, every other channel is served, and the channel is served once the lock is let go."""
    k = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 0.5\n')
    bad = committed_workspace(tmp_path / "bad")
    good = committed_workspace(tmp_path / "good")
    counter = tmp_path / "runs.txt"
    k.enroll(bad)
    k.enroll(good)
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(bad / ".syscall")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert locker.stdout is not None
        assert locker.stdout.readline() == "locked\n"
        k.start()
        k.wait_log("event=channel_held_elsewhere", 10)
        launch_and_wait(good, counter, "good")
        shown = json.loads(k.cli("status", "--json").stdout)
        problems = {w["path"]: w["problem"] for w in shown["workspaces"]}
        assert f"served by another kernel (pid {locker.pid})" in problems[str(bad.resolve())]
        assert problems[str(good.resolve())] is None
        put_request(bad, "0-st", status("0-st"))
        time.sleep(1.5)  # three rescans
        assert read_answer(bad, "0-st") is None
        locker.kill()
        locker.wait()
        assert wait_answer(bad, "0-st", 10)["type"] == "status"
        k.wait_log("event=channel_lock_taken", 10)
        shown = json.loads(k.cli("status", "--json").stdout)
        assert all(w["problem"] is None for w in shown["workspaces"])
        assert k.stop() == 0
    finally:
        locker.kill()
        locker.wait()
        if locker.stdout is not None:
            locker.stdout.close()
        k.ensure_stopped()
