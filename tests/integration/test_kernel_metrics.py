"""The Prometheus endpoint (issue 12): scraped over HTTP, its numbers checked against what the test did."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kernelproc import Kernel, git_workspace, put_request, status, wait_answer, wait_for

from channel import release
from channel.paths import workspace_key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def value(text: str, name: str, **labels: str) -> float | None:
    """The sample `name{labels}` (labels in any order) of a scrape, or None."""
    for m in re.finditer(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if m.group(1) == name and got == labels:
            return float(m.group(3))
    return None


def test_metrics_count_requests_latency_sleeps_tasks_and_budgets(tmp_path: Path) -> None:
    port = free_port()
    k = Kernel(tmp_path, f'backend = "none"\nmetrics_listen = "127.0.0.1:{port}"\n[defaults]\nlaunches = 9\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    key = workspace_key(str(ws.resolve()))
    k.start()
    try:
        k.wait_log("event=metrics_listening", 10)
        for i in range(3):
            put_request(ws, f"s{i}", status(f"s{i}"))
            wait_answer(ws, f"s{i}")
        put_request(ws, "bad", b'{"protocol": 1, "id": "bad", "type": "status", "extra": 1}')
        wait_answer(ws, "bad")
        tool = [sys.executable, str(ws / ".syscall" / "syscall")]
        subprocess.run(
            [*tool, "launch", "--name", "a", "--", "true"], cwd=ws, check=True, capture_output=True
        )
        subprocess.run([*tool, "sleep", "--json"], cwd=ws, check=True, capture_output=True, timeout=60)

        def settled() -> str | None:
            text = scrape(port)
            return text if value(text, "syscall_kernel_tasks", state="PENDING") == 1 else None

        # The state gauges are set from the store every 5 s.
        text = wait_for(settled, 20, "the task gauge", step=0.5)
        assert value(text, "syscall_kernel_requests_total", verb="status", outcome="answered") == 3
        assert value(text, "syscall_kernel_requests_total", verb="request", outcome="rejected") == 1
        assert value(text, "syscall_kernel_requests_total", verb="sleep", outcome="accepted") == 1
        assert value(text, "syscall_kernel_answer_seconds_count") == 5
        assert (value(text, "syscall_kernel_pass_seconds_count") or 0) >= 5
        sleeps = re.findall(r'^syscall_kernel_sleeps\{state="(\w+)"\} (\S+)$', text, re.M)
        assert [(state, float(n)) for state, n in sleeps if float(n)] == [("validated", 1.0)], sleeps
        assert value(text, "syscall_kernel_budget_left", workspace=key, kind="launches") == 8
        assert value(text, "syscall_kernel_budget_left", workspace=key, kind="sleeps") is not None
        assert value(text, "syscall_kernel_workspaces") == 1
        assert value(text, "syscall_kernel_channels_with_problems") == 0
        assert value(text, "syscall_kernel_degraded") == 0
        # the release that runs, as kernel.json names it
        info = json.loads((ws / ".syscall" / "kernel.json").read_bytes())["kernel"]
        assert info["version"] == release.VERSION
        assert info["commit"] == release.COMMIT
        assert value(text, "syscall_kernel_build_info", version=release.VERSION, commit=info["commit"]) == 1
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_metrics_are_off_by_default(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'backend = "none"\n')
    k.start()
    try:
        assert "metrics_listening" not in k.log_text()
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_the_process_collector_reports_the_kernels_own_process(tmp_path: Path) -> None:
    """The standard process metrics (Prometheus conventions), from the kernel's /proc/self."""
    port = free_port()
    k = Kernel(tmp_path, f'backend = "none"\nmetrics_listen = "127.0.0.1:{port}"\n')
    before = time.time()
    proc = k.start()
    try:
        k.wait_log("event=metrics_listening", 10)
        text = scrape(port)
        started = value(text, "process_start_time_seconds")
        assert started is not None, text
        assert before - 2 <= started <= time.time(), (before, started)
        fds = value(text, "process_open_fds")
        assert fds is not None
        assert (
            abs(fds - len(os.listdir(f"/proc/{proc.pid}/fd"))) < 8
        )  # the kernel's own fds, give or take a pipe
        rss = value(text, "process_resident_memory_bytes")
        assert rss is not None
        assert rss > 1 << 20
        assert (value(text, "process_cpu_seconds_total") or -1) >= 0
        assert value(text, "process_max_fds") is not None
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_a_port_another_kernel_holds_is_named_by_check_and_by_metrics_failed(tmp_path: Path) -> None:
    """Two users' kernels with the same metrics_listen (one config copied for both): the second cannot listen.
    `check` says so before the start, naming who holds the port; `metrics_failed` names it too. The first
    kernel's own `check` sees its port served by itself."""
    port = free_port()
    conf = f'backend = "none"\nmetrics_listen = "127.0.0.1:{port}"\n'
    first, second = Kernel(tmp_path, conf, name="alice"), Kernel(tmp_path, conf, name="bob")
    assert f"127.0.0.1:{port} is free" in first.cli("check").stdout
    a = first.start()
    try:
        first.wait_log("event=metrics_listening", 10)
        mine = first.cli("check").stdout
        assert f"served by this config's kernel, pid {a.pid}" in mine, mine
        out = second.cli("check").stdout
        line = next(ln for ln in out.splitlines() if "metrics" in ln)
        assert f"127.0.0.1:{port} is in use by uid {os.geteuid()}" in line, out
        assert f"pid {a.pid} (" in line, line
        assert "serve" in line, line
        assert "a port of its own" in line, line
        second.start()
        second.wait_log("event=metrics_failed", 10)
        failed = next(ln for ln in second.log_text().splitlines() if "metrics_failed" in ln)
        assert f"pid {a.pid}" in failed, failed
        assert second.stop() == 0
        assert first.stop() == 0
    finally:
        second.ensure_stopped()
        first.ensure_stopped()


def test_idle_polled_channels_are_looked_at_not_listed_and_a_request_is_still_answered(
    tmp_path: Path,
) -> None:
    """`watch = "poll"`: each look at an idle channel is one stat of its requests/, counted `unchanged`; only a
    changed one is listed (`listed`). A request renamed into one of 20 idle channels is answered, and so is the
    next one."""
    port = free_port()
    k = Kernel(
        tmp_path,
        f'backend = "none"\nwatch = "poll"\npoll_seconds = 0.2\npoll_idle_seconds = 1\nrescan_seconds = 600\n'
        f'metrics_listen = "127.0.0.1:{port}"\n',
    )
    spaces = [git_workspace(tmp_path / f"ws{i}") for i in range(20)]
    for ws in spaces:
        k.enroll(ws)
    k.start()
    try:
        k.wait_log("event=metrics_listening", 10)
        time.sleep(4)  # every channel listed once, then idle: looked at once a second
        before = scrape(port)
        time.sleep(3)
        after = scrape(port)
        unchanged = (value(after, "syscall_kernel_poll_looks_total", outcome="unchanged") or 0) - (
            value(before, "syscall_kernel_poll_looks_total", outcome="unchanged") or 0
        )
        listed = (value(after, "syscall_kernel_poll_looks_total", outcome="listed") or 0) - (
            value(before, "syscall_kernel_poll_looks_total", outcome="listed") or 0
        )
        assert listed == 0, (before, after)
        assert 20 * 2 <= unchanged <= 20 * 3 * 2, unchanged  # once a second each (a tick's slack either way)
        # (the latencies are bench/poll_idle.py's to measure; here only that both are answered)
        put_request(spaces[7], "q1", status("q1"))
        wait_answer(spaces[7], "q1", timeout=10)
        put_request(spaces[7], "q2", status("q2"))
        wait_answer(spaces[7], "q2", timeout=10)
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
