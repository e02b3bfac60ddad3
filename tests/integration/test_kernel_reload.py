"""SIGHUP and live globs (issue 12, defects 3 and 9), and the log's times and JSON form (defect 11).

SIGHUP used to kill the kernel silently (a clean exit to systemd, so `Restart=on-failure` did nothing), and the
`workspaces` globs were read only at start.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from kernelproc import Kernel, git_workspace, put_request, run_tool, status, wait_answer, wait_for


def kernel_json(ws: Path) -> dict[str, object]:
    try:
        return json.loads((ws / ".syscall" / "kernel.json").read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_sighup_reloads_the_config_and_globs_are_live(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    a = git_workspace(one / "a")
    base = 'backend = "none"\nrescan_seconds = 0.5\n'
    k = Kernel(tmp_path, f'{base}workspaces = ["{one}/*"]\n[defaults]\nmax_minutes = 60\n')
    k.start()
    try:
        assert k.proc is not None
        assert kernel_json(a)["policy"]["max_minutes"] == 60  # type: ignore[index]
        # Live globs: a new match is enrolled at the next rescan, without a signal.
        c = git_workspace(one / "c")
        wait_for(lambda: kernel_json(c), 10, "c enrolled by the rescan")
        put_request(c, "s1", status("s1"))
        wait_answer(c, "s1")

        # SIGHUP: new globs and defaults apply; the backend and the state dir cannot change live.
        b = git_workspace(two / "b")
        text = k.config.read_text()
        text = text.replace(f'workspaces = ["{one}/*"]', f'workspaces = ["{one}/*", "{two}/*"]')
        text = text.replace("max_minutes = 60", "max_minutes = 30").replace(
            'backend = "none"', 'backend = "local"'
        )
        k.config.write_text(text)
        k.proc.send_signal(signal.SIGHUP)
        k.wait_log("event=reloaded", 10)
        assert k.proc.poll() is None
        log = k.log_text()
        assert "event=reload_kept key=backend" in log
        assert re.search(r"event=reloaded \S+ changed=workspaces,defaults\.max_minutes", log), log[-2000:]
        wait_for(lambda: kernel_json(b), 10, "b enrolled at the reload")
        for ws in (a, b, c):
            wait_for(lambda ws=ws: kernel_json(ws)["policy"]["max_minutes"] == 30, 10, "the new policy")  # type: ignore[index]
        put_request(b, "s2", status("s2"))
        wait_answer(b, "s2")

        # A config that no longer loads is refused by name; the kernel keeps serving with the running one.
        k.config.write_text(text + "bogus_key = 1\n")
        k.proc.send_signal(signal.SIGHUP)
        k.wait_log("event=reload_failed", 10)
        assert "bogus_key" in k.log_text()
        put_request(a, "s3", status("s3"))
        wait_answer(a, "s3")
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
    # Every line starts with an RFC 3339 time with its zone.
    for line in k.log_text().splitlines():
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d [A-Z]+ event=", line), line


def test_a_policy_changed_by_sighup_is_announced_to_the_agent_once(tmp_path: Path) -> None:
    """The operator lowers max_minutes with a reload while the agent works: its next call says so, once (before:
    kernel.json changed and nothing told the agent)."""
    ws = git_workspace(tmp_path / "spaces" / "a")
    k = Kernel(
        tmp_path,
        f'backend = "none"\nworkspaces = ["{tmp_path / "spaces"}/*"]\n[defaults]\nmax_minutes = 60\n',
    )
    k.start()
    try:
        assert k.proc is not None

        def tool(*args: str) -> str:
            done = run_tool(ws, *args, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout + done.stderr

        assert "Note:" not in tool("status")
        k.config.write_text(k.config.read_text().replace("max_minutes = 60", "max_minutes = 30"))
        k.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: kernel_json(ws).get("policy", {}).get("max_minutes") == 30, 10, "the new policy")  # type: ignore[union-attr]
        told = tool("status")
        assert told.startswith(
            "Note: this workspace's contract in .syscall/kernel.json changed since this tool last read it: "
            "policy.max_minutes 60 -> 30 (`python3 .syscall/syscall status` shows it as it is now).\n"
        ), told
        assert "at most 30 minutes" in told
        assert "Note:" not in tool("status")
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_log_format_json_writes_one_object_per_line(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\nlog_format = "json"\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.start(wait_ready=False)
    try:
        k.wait_log('"event": "ready"', 30)
        put_request(ws, "s1", status("s1"))
        wait_answer(ws, "s1")
        k.wait_log('"event": "answered"', 10)
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
    lines = [json.loads(line) for line in k.log_text().splitlines()]
    assert all(re.match(r"^\d{4}-\d\d-\d\dT.*[+-]\d\d:\d\d$", o["time"]) for o in lines)
    [answered] = [o for o in lines if o["event"] == "answered"]
    assert (answered["level"], answered["id"], answered["outcome"]) == ("info", "s1", "status")
    # Numbers are JSON numbers, not strings (issue 24): a log pipeline sums and compares them as written.
    assert isinstance(answered["ms"], float), answered
    [ready] = [o for o in lines if o["event"] == "ready"]
    assert isinstance(ready["workspaces"], int), ready


def test_a_refresh_while_serving_removes_only_temps_older_than_the_kernel(tmp_path: Path) -> None:
    """A channel refreshed while the kernel serves (a reload that changes its policy; a new glob match; a channel
    taken back) sweeps leftover kernel temps. It used to remove every `.kernel-*.tmp`, also one that another writer
    had in flight at that moment (`syscall-kernel budget`/`enroll` writing budget.json; since channel I/O left the
    store worker, the kernel's own answer and budget.json writes too), whose rename then failed: the write was
    lost. Only a temp older than this kernel process is a leftover."""
    import os
    import time

    ws = git_workspace(tmp_path / "one" / "a")
    k = Kernel(
        tmp_path, f'backend = "none"\nworkspaces = ["{tmp_path / "one"}/*"]\n[defaults]\nmax_minutes = 60\n'
    )
    k.start()
    try:
        assert k.proc is not None
        channel = ws / ".syscall"
        leftover = channel / ".kernel_00000000000000aa.tmp"
        in_flight = channel / ".kernel_00000000000000bb.tmp"
        answers_in_flight = channel / "answers" / ".kernel_00000000000000cc.tmp"
        for p in (leftover, in_flight, answers_in_flight):
            p.write_bytes(b"{}")
        long_ago = time.time() - 3600
        os.utime(leftover, (long_ago, long_ago))
        k.config.write_text(k.config.read_text().replace("max_minutes = 60", "max_minutes = 30"))
        k.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: kernel_json(ws).get("policy", {}).get("max_minutes") == 30, 10, "the new policy")  # type: ignore[union-attr]
        wait_for(lambda: not leftover.exists(), 10, "the leftover temp swept")
        assert in_flight.exists()
        assert answers_in_flight.exists()
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
