"""End to end: one sleep's GPU launches share the workspace's max_concurrent_gpus (the installed tool, a real
kernel process, the local backend and the bwrap jail). The local backend runs `--gpus` tasks on a machine
without GPUs (it binds none), so the ceiling is watched through the tasks' own start and end stamps."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, run_tool, wait_for

from channel.paths import workspace_key

pytestmark = pytest.mark.bwrap

# max_parallel well above the ceiling: only max_concurrent_gpus may bound how many tasks run together.
CONFIG = 'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\nmax_parallel = 8\n'
CEILING = ("--max-concurrent-gpus", "2")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[tuple[Kernel, Path]]:
    tmp = tmp_path_factory.mktemp("gpushare")
    k = Kernel(tmp, CONFIG)
    ws = make_workspace(tmp / "ws", {"README": "gpu share\n"})
    k.enroll(ws, "--launches", "20", "--sleeps", "10", "--gpu-hours", "4", *("--max-gpus", "1"), *CEILING)
    k.start()
    try:
        yield k, ws
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def ok(ws: Path, *args: str) -> str:
    done = run_tool(ws, *args, timeout=90)
    assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
    return done.stdout


def spans_of(sleep_dir: Path, tasks: list[str]) -> list[tuple[datetime, datetime]]:
    def stamp(task: str, name: str) -> datetime:
        return datetime.fromisoformat((sleep_dir / task / name).read_text().strip().replace("Z", "+00:00"))

    return [(stamp(t, "started"), stamp(t, "ended")) for t in tasks]


def most_at_once(spans: list[tuple[datetime, datetime]]) -> int:
    """The most tasks running at one moment: at each start, those started and not yet ended."""
    return max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)


def test_two_gpu_launches_of_one_sleep_together_stay_within_max_concurrent_gpus(
    kernel: tuple[Kernel, Path],
) -> None:
    """max_concurrent_gpus 2 and two `--gpus 1 --array 3` launches in one sleep: each was sized alone (2 at a
    time: 4 GPUs at once); they share the ceiling, 1 at a time each, and no moment has more than 2 running."""
    k, ws = kernel
    for name in ("left", "right"):
        ok(ws, "launch", "--name", name, "--gpus", "1", "--array", "3", "--minutes", "20", "--", "sleep 1")
    wake: dict[str, Any] = json.loads(ok(ws, "sleep", "--wait", "--json", "--timeout", "80"))
    assert [t["state"] for t in wake["tasks"]] == ["COMPLETED"] * 6
    assert [(x["name"], x["at_a_time"]) for x in wake["launches"]] == [("left", 1), ("right", 1)]
    assert wake["launches"][0]["clamp"] == (
        "1 at a time, not all 3: its share, at the sleep's acceptance, of this workspace's max_concurrent_gpus "
        "(2 GPUs at once now), beside any other GPU launches of the sleep and any sleeps in flight then; each "
        "task takes 1 GPU"
    )
    sleep_dir = k.state / "runs" / workspace_key(ws.resolve()) / str(wake["seq"])
    spans = spans_of(sleep_dir, [f"{n}.{i}" for n in ("left", "right") for i in range(3)])
    assert most_at_once(spans) <= 2, f"more than 2 GPU tasks ran at once: {sorted(spans)}"


def test_a_sleep_beside_one_holding_gpus_gets_what_it_leaves(kernel: tuple[Kernel, Path]) -> None:
    """A sleep in flight holds 1 of the 2 GPUs (`--concurrency 1`): the next `--gpus 1 --array 3` is accepted
    with 1 at a time (it was refused: sized alone it wanted 2 more), and the two together never run more than
    2 tasks at once."""
    k, ws = kernel
    ok(ws, "launch", "--name", "first", "--gpus", "1", "--array", "2", "--concurrency", "1", "--", "sleep 1")
    first = json.loads(ok(ws, "sleep", "--json"))
    ok(ws, "launch", "--name", "second", "--gpus", "1", "--array", "3", "--", "sleep 1")
    second = json.loads(ok(ws, "sleep", "--json"))
    assert second["type"] == "accepted", second
    wakes = {}
    for each in (first, second):
        wakes[each["sleep_seq"]] = json.loads(ok(ws, "wait", each["id"], "--json", "--timeout", "80"))
    late = wakes[second["sleep_seq"]]
    assert [(x["name"], x["at_a_time"]) for x in late["launches"]] == [("second", 1)]
    runs = k.state / "runs" / workspace_key(ws.resolve())
    spans = spans_of(runs / str(first["sleep_seq"]), ["first.0", "first.1"])
    spans += spans_of(runs / str(second["sleep_seq"]), ["second.0", "second.1", "second.2"])
    assert all(t["state"] == "COMPLETED" for w in wakes.values() for t in w["tasks"])
    assert most_at_once(spans) <= 2, f"more than 2 GPU tasks ran at once: {sorted(spans)}"


def test_a_lowered_ceiling_applies_to_sleeps_accepted_after_the_reload(
    tmp_path: Path, bwrap_available: None
) -> None:
    """A sleep accepted under max_concurrent_gpus 2 keeps its 2 at a time after a reload lowers the ceiling to
    1 (status says so); the next GPU sleep is refused while it holds them, and accepted at 1 once it is over."""
    k = Kernel(tmp_path, f"{CONFIG}[defaults]\nmax_gpus = 1\nmax_concurrent_gpus = 2\n")
    ws = make_workspace(tmp_path / "ws", {"README": "reload\n"})
    k.enroll(ws, "--launches", "20", "--sleeps", "10", "--gpu-hours", "4")
    k.start()
    try:
        ok(
            ws,
            "launch",
            "--name",
            "held",
            "--gpus",
            "1",
            "--array",
            "4",
            "--minutes",
            "30",
            "--",
            "sleep 300",
        )
        held = json.loads(ok(ws, "sleep", "--json"))
        assert k.proc is not None
        k.config.write_text(
            k.config.read_text().replace("max_concurrent_gpus = 2", "max_concurrent_gpus = 1")
        )
        k.proc.send_signal(signal.SIGHUP)
        k.wait_log("event=reloaded", 10)
        policy = ws / ".syscall" / "kernel.json"
        wait_for(
            lambda: json.loads(policy.read_text())["policy"]["max_concurrent_gpus"] == 1, 10, "the reload"
        )
        shown = json.loads(ok(ws, "status", "--sleep", held["id"], "--json"))["answer"]["sleep"]
        assert [(x["name"], x["at_a_time"]) for x in shown["launches"]] == [("held", 2)]
        # not "at most 1 GPU at once", which 2 at a time would belie
        assert shown["launches"][0]["clamp"] == (
            "2 at a time, not all 4: its share, at the sleep's acceptance, of this workspace's max_concurrent_gpus "
            "(1 GPU at once now), beside any other GPU launches of the sleep and any sleeps in flight then; each "
            "task takes 1 GPU"
        )
        ok(ws, "launch", "--name", "next", "--gpus", "1", "--array", "2", "--", "true")
        refused = run_tool(ws, "sleep", "--json", timeout=90)
        assert refused.returncode != 0
        assert "sleep.in_progress" in refused.stdout + refused.stderr
        assert "may hold 2 GPUs at once, leaving 0 of this workspace's max_concurrent_gpus (1)" in (
            refused.stdout + refused.stderr
        )
        ok(ws, "cancel", "--sleep", held["id"])
        ok(ws, "wait", held["id"], "--json", "--timeout", "60")
        accepted = json.loads(ok(ws, "sleep", "--json"))
        wake = json.loads(ok(ws, "wait", accepted["id"], "--json", "--timeout", "60"))
        assert [(x["name"], x["at_a_time"]) for x in wake["launches"]] == [("next", 1)]
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
