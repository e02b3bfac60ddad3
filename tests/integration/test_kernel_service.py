"""A real kernel process on real directories: requests answered, hostile files and floods isolated, sd_notify."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernelproc import (
    Kernel,
    git_workspace,
    put_request,
    read_answer,
    run_tool,
    status,
    wait_answer,
    wait_for,
)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    # The pipeline alone: sleeps are recorded and answered, nothing runs (execution has its own e2e tests).
    k = Kernel(tmp_path, 'rescan_seconds = 2\nbackend = "none"\n')
    yield k
    k.ensure_stopped()


def sleep_request(rid: str, *launches: dict[str, object]) -> dict[str, object]:
    return {"protocol": 1, "id": rid, "type": "sleep", "launches": list(launches)}


def test_every_verb_is_answered_from_the_store(kernel: Kernel, tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    other = git_workspace(tmp_path / "other")
    kernel.enroll(ws, "--launches", "5", "--sleeps", "3", "--gpu-hours", "2", "--max-sleeps-in-flight", "1")
    kernel.enroll(other)
    kernel.start()

    put_request(ws, "s1", status("s1"))
    st = wait_answer(ws, "s1")
    assert st["type"] == "status"
    assert st["budget"] == {"launches": 5, "sleeps": 3, "gpu_hours": 2.0, "reserved_gpu_hours": 0.0}
    assert st["sleep"] is None

    train = {"name": "train", "command": "python train.py", "minutes": 30, "gpus": 1, "array": 2, "why": "lr"}
    put_request(ws, "z1", sleep_request("z1", train, {"name": "eval", "command": "true"}))
    acc = wait_answer(ws, "z1")
    assert acc["type"] == "accepted", acc
    assert acc["sleep_seq"] == 1
    assert [(j["launch"], j["task"], j["job_id"]) for j in acc["jobs"]] == [
        ("train", 0, None),
        ("train", 1, None),
        ("eval", 0, None),
    ]
    assert acc["budget"] == {"launches": 3, "sleeps": 2, "gpu_hours": 1.0, "reserved_gpu_hours": 1.0}
    budget_file = json.loads((ws / ".syscall" / "budget.json").read_bytes())
    assert budget_file["budget"] == acc["budget"]

    put_request(ws, "z2", sleep_request("z2"))
    assert wait_answer(ws, "z2")["error"] == {
        "code": "sleep.in_progress",
        "message": "already 1 sleep in flight (max_sleeps_in_flight 1): 'z1' (seq 1); wait for a wake, or cancel "
        "a sleep's launches",
        "path": None,
    }

    put_request(other, "q1", {"protocol": 1, "id": "q1", "type": "queue"})
    q = wait_answer(other, "q1")
    assert [(e["mine"], e["launch"], e["state"]) for e in q["jobs"]] == [
        (False, "train", "PENDING"),
        (False, "train", "PENDING"),
        (False, "eval", "PENDING"),
    ]

    put_request(ws, "c1", {"protocol": 1, "id": "c1", "type": "cancel", "launches": ["train"]})
    c = wait_answer(ws, "c1")
    assert c["type"] == "cancelled"
    assert c["sleep"] == "z1"
    assert [(j["launch"], j["task"]) for j in c["cancelled"]] == [("train", 0), ("train", 1)]
    assert c["budget"] == {"launches": 3, "sleeps": 2, "gpu_hours": 2.0, "reserved_gpu_hours": 0.0}
    # A second cancel of the same launch stops nothing and says so (it answered the same two jobs again).
    put_request(ws, "c1b", {"protocol": 1, "id": "c1b", "type": "cancel", "launches": ["train"]})
    assert wait_answer(ws, "c1b")["cancelled"] == []
    put_request(ws, "c2", {"protocol": 1, "id": "c2", "type": "cancel", "launches": ["nope"]})
    assert wait_answer(ws, "c2")["error"] == {
        "code": "cancel.unknown_launch",
        "message": "'nope' is not a launch of sleep 'z1' (its launches: eval, train)",
        "path": "$.launches[0]",
    }

    put_request(ws, "h1", {"protocol": 1, "id": "h1", "type": "history"})
    h = wait_answer(ws, "h1")
    assert [(s["id"], s["state"]) for s in h["sleeps"]] == [("z1", "validated")]
    launches = {x["name"]: tuple(x["states"]) for x in h["sleeps"][0]["launches"]}
    assert launches == {"train": ("CANCELLED", "CANCELLED"), "eval": ("PENDING",)}

    put_request(ws, "bad", b'{"protocol": 1, "id": "bad", "type": "status",}')
    assert wait_answer(ws, "bad")["error"]["code"] == "json.syntax"
    put_request(ws, "gpu", sleep_request("gpu", {"name": "x", "command": "y", "gpus": 9}))
    assert wait_answer(ws, "gpu")["error"]["code"] == "policy.gpus"

    # A replay with the same bytes gets the stored answer again; other bytes under the same id are refused.
    first = (ws / ".syscall" / "answers" / "s1.json").read_bytes()
    (ws / ".syscall" / "answers" / "s1.json").unlink()
    put_request(ws, "s1", status("s1"))
    assert wait_answer(ws, "s1") == json.loads(first)
    put_request(ws, "s1", {"protocol": 1, "id": "s1", "type": "history"})
    wait_for(lambda: (read_answer(ws, "s1") or {}).get("type") == "rejected", 10, "the reused id's refusal")
    assert read_answer(ws, "s1")["error"]["code"] == "request.id.reused"  # type: ignore[index]

    # Junk names are removed without an answer; the request directory ends empty.
    (ws / ".syscall" / "requests" / "NOT A REQUEST\x07").write_text("x")
    put_request(ws, "s9", status("s9"))
    wait_answer(ws, "s9")
    wait_for(lambda: not list((ws / ".syscall" / "requests").iterdir()), 10, "an empty requests/")

    out = json.loads(kernel.cli("status", "--json").stdout)
    mine = next(w for w in out["workspaces"] if w["path"] == str(ws))
    assert mine["sleep"]["id"] == "z1"
    assert mine["budget"]["launches"] == 3
    assert kernel.stop() == 0
    log = kernel.log_text()
    assert "event=answered ws=ws-" in log
    assert "id=z1 outcome=accepted" in log


def test_hostile_files_and_a_flood_never_stall_another_channel(kernel: Kernel, tmp_path: Path) -> None:
    flood_n = int(os.environ.get("SYSCALL_TEST_FLOOD", "10000"))
    bad = git_workspace(tmp_path / "bad")
    good = git_workspace(tmp_path / "good")
    kernel.enroll(bad)
    kernel.enroll(good)
    kernel.start()
    req = bad / ".syscall" / "requests"
    os.mkfifo(req / "0-fifo.json")
    outside = tmp_path / "secret.txt"
    outside.write_text('{"protocol": 1, "id": "0-link", "type": "status"}')
    (req / "0-link.json").symlink_to(outside)
    os.link(outside, req / "0-hard.json")
    with open(req / "0-sparse.json", "wb") as f:
        f.truncate(1 << 30)
    for i in range(flood_n):
        (req / f".f{i:05d}.tmp").write_bytes(json.dumps(status(f"f{i:05d}")).encode())
        os.rename(req / f".f{i:05d}.tmp", req / f"f{i:05d}.json")

    for attempt in range(3):
        rid = f"good-{attempt}"
        started = time.monotonic()
        put_request(good, rid, status(rid))
        wait_answer(good, rid, timeout=2.0)
        assert time.monotonic() - started < 2.0
    # Answered while the flood was still being worked through: fairness, not just speed.
    assert len(os.listdir(req)) > flood_n // 2

    codes = {
        rid: wait_answer(bad, rid, timeout=10)["error"]["code"]
        for rid in ("0-fifo", "0-link", "0-hard", "0-sparse")
    }
    assert codes == {
        "0-fifo": "request.unreadable",
        "0-link": "request.unreadable",
        "0-hard": "request.unreadable",
        "0-sparse": "request.too_large",
    }
    assert "status" not in read_answer(bad, "0-link")["error"]["message"]  # type: ignore[index]
    assert outside.read_text().startswith('{"protocol"')
    # The kernel's own answer to the flood starts within the deadline too, and it stops cleanly mid-flood.
    wait_answer(bad, "f00000", timeout=10)
    assert kernel.stop() == 0


def test_sd_notify_contract(kernel: Kernel, tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    kernel.enroll(ws)
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        srv.settimeout(30)
        proc = kernel.start({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}, wait_ready=False)
        first = srv.recv(4096).decode().splitlines()
        assert first[0] == "READY=1"
        assert first[1].startswith("STATUS=serving 1 workspaces (1 inotify, 0 poll)")
        assert f"MAINPID={proc.pid}" in first
        pings = 0
        while pings < 5:
            msg = srv.recv(4096).decode()
            if msg == "WATCHDOG=1":
                pings += 1
        proc.send_signal(signal.SIGTERM)
        rest: list[str] = []
        while not any(m.startswith("STOPPING=1") for m in rest):
            rest.append(srv.recv(4096).decode())
        assert rest[-1].splitlines()[1].startswith("STATUS=draining (SIGTERM)")
        assert proc.wait(30) == 0
        srv.settimeout(0.001)
        after: list[str] = []
        try:
            while True:
                after.append(srv.recv(4096).decode())
        except TimeoutError:
            pass
        assert "WATCHDOG=1" not in after


def test_poll_mode_answers_without_events(tmp_path: Path) -> None:
    k = Kernel(tmp_path, 'watch = "poll"\npoll_seconds = 0.1\n')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    try:
        k.start()
        assert "polled=1" in k.log_text()
        put_request(ws, "p1", status("p1"))
        assert wait_answer(ws, "p1", timeout=5)["type"] == "status"
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_globs_enroll_at_start_and_enroll_while_serving(tmp_path: Path) -> None:
    root = tmp_path / "agents"
    a = git_workspace(root / "a")
    (root / "not-git").mkdir(parents=True)
    k = Kernel(tmp_path, f'workspaces = ["{root}/*"]\n')
    try:
        k.start()
        assert "event=enroll_refused" in k.log_text()
        assert "not a git repository" in k.log_text()
        put_request(a, "g1", status("g1"))
        assert wait_answer(a, "g1")["type"] == "status"
        late = git_workspace(tmp_path / "late")
        k.enroll(late)
        put_request(late, "l1", status("l1"))
        assert wait_answer(late, "l1", timeout=10)["type"] == "status"
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_a_swapped_channel_is_not_served(kernel: Kernel, tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    kernel.enroll(ws)
    kernel.start()
    put_request(ws, "a1", status("a1"))
    wait_answer(ws, "a1")
    (ws / ".syscall").rename(ws / "old")
    decoy = tmp_path / "decoy"
    for sub in ("requests", "answers"):
        (decoy / sub).mkdir(parents=True)
    (ws / ".syscall").symlink_to(decoy)
    put_request(ws, "a2", status("a2"))
    kernel.wait_log("event=channel_problem", 10)
    assert read_answer(ws, "a2") is None
    assert (decoy / "requests" / "a2.json").exists()
    # The enrolled directory comes back: it is served again (the rescan finds it).
    (ws / ".syscall").unlink()
    (ws / "old").rename(ws / ".syscall")
    put_request(ws, "a3", status("a3"))
    assert wait_answer(ws, "a3", timeout=10)["type"] == "status"
    kernel.wait_log("event=channel_ok", 10)
    assert kernel.stop() == 0


def test_the_rescan_finds_what_no_event_announced(tmp_path: Path) -> None:
    # Every way to make a name in requests/ raises an event the watcher takes (IN_CREATE too, since requests
    # made by link or mkfifo must be refused at once), so here no event is taken at all: the channel is
    # polled, once every 600 s, and only the rescan (every 2 s) can find the request.
    kernel = Kernel(tmp_path, 'rescan_seconds = 2\nbackend = "none"\nwatch = "poll"\npoll_seconds = 600\n')
    ws = git_workspace(tmp_path / "ws")
    kernel.enroll(ws)
    kernel.start()
    try:
        time.sleep(0.5)  # past the first sweep after ready
        put_request(ws, "quiet", status("quiet"))
        assert wait_answer(ws, "quiet", timeout=10)["type"] == "status"
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def _rescan_looks(port: int, outcome: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    got = re.search(rf'^syscall_kernel_rescan_looks_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(got.group(1)) if got else 0.0


def test_the_rescan_skips_an_unchanged_channel_and_still_finds_a_request_whose_mtime_was_put_back(
    tmp_path: Path,
) -> None:
    # Polled once every 600 s: only the rescan (every 2 s) can find the request. Once the channel's evidence is
    # confirmed, a rescan that finds it unchanged lists nothing (`unchanged`); the request then renamed in has its
    # directory's mtime put back as it was (all an agent can do: the ctime moves on, and nobody can set it), and
    # the rescan still answers it. A rescan that skipped channels would not.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    kernel = Kernel(
        tmp_path,
        'rescan_seconds = 2\nbackend = "none"\nwatch = "poll"\npoll_seconds = 600\n'
        f'metrics_listen = "127.0.0.1:{port}"\n',
    )
    ws = git_workspace(tmp_path / "ws")
    kernel.enroll(ws)
    kernel.start()
    try:
        kernel.wait_log("event=metrics_listening", 10)
        wait_for(
            lambda: _rescan_looks(port, "unchanged") >= 2, 30, "a rescan that found the channel unchanged"
        )
        checked = _rescan_looks(port, "checked")
        requests = ws / ".syscall" / "requests"
        before = requests.stat()
        put_request(ws, "hidden", status("hidden"))
        os.utime(requests, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert requests.stat().st_mtime_ns == before.st_mtime_ns
        assert wait_answer(ws, "hidden", timeout=15)["type"] == "status"
        assert _rescan_looks(port, "checked") > checked  # the rescan found it
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def test_bad_config_is_refused_with_the_key(tmp_path: Path) -> None:
    k = Kernel(tmp_path, "[defaults]\nlaunches = 'many'\n")
    out = k.cli("serve", check=False)
    assert out.returncode == 2
    assert f"{k.config}: key 'defaults.launches'" in out.stderr


def test_the_installed_tool_talks_to_the_kernel(kernel: Kernel, tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    kernel.enroll(ws, "--launches", "4", "--max-sleeps-in-flight", "1")
    kernel.start()

    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        return run_tool(ws, *args, timeout=60)

    st = tool("status", "--json")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["answer"]["budget"]["launches"] == 4
    assert tool("launch", "--name", "t", "--minutes", "5", "--", "echo", "hi").returncode == 0
    slept = tool("sleep", "--json")
    assert slept.returncode == 0, slept.stderr
    accepted = json.loads(slept.stdout)
    assert accepted["type"] == "accepted"
    assert accepted["budget"]["launches"] == 3
    again = tool("sleep")
    assert again.returncode == 3, again.stdout + again.stderr  # rejected by the kernel: sleep.in_progress
    assert "sleep.in_progress" in again.stdout + again.stderr
    assert kernel.stop() == 0
