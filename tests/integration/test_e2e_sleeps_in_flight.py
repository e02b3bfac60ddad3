"""End to end: several sleeps in flight (issue 25), with the installed tool and a real kernel process.

Two sleeps run at once, each held by a gate file outside its tree (`jail = "none"`), so which one is in flight
when is the test's choice, never a race: each gets its own snapshot, results, wake and charge; `status` lists
both; `cancel` without a sleep asks which; `tail` finds the launch in the sleep that has it; `queue` names each
job's sleep; `wait` without an id shows the first wake and then the other; the policy's `max_sleeps_in_flight`
refuses one more, nothing charged.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from kernelproc import Kernel, make_workspace, run_tool, wait_for


def gated(gate: Path, word: str) -> str:
    return f"echo {word}-started; while [ ! -e {gate} ]; do sleep 0.05; done; echo {word}-done"


def test_two_sleeps_in_flight_each_with_its_own_wake_and_charge(tmp_path: Path) -> None:
    kernel = Kernel(tmp_path, 'backend = "local"\njail = "none"\n')
    ws = make_workspace(tmp_path / "ws")
    kernel.enroll(ws, "--launches", "10", "--sleeps", "10", "--max-sleeps-in-flight", "2")
    kernel.start()

    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        return run_tool(ws, *args, timeout=60)

    def ok(*args: str) -> str:
        done = tool(*args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    def slept() -> dict[str, Any]:
        ans: dict[str, Any] = json.loads(ok("sleep", "--json"))
        assert ans["type"] == "accepted", ans
        return ans

    gate_a, gate_b = tmp_path / "gate-a", tmp_path / "gate-b"
    try:
        ok("launch", "--name", "slow", "--minutes", "5", "--", gated(gate_a, "slow"))
        a = slept()
        ok("launch", "--name", "quick", "--minutes", "5", "--", gated(gate_b, "quick"))
        b = slept()
        assert b["sleep_seq"] == a["sleep_seq"] + 1
        assert (a["budget"]["sleeps"], b["budget"]["sleeps"]) == (9, 8)  # each sleep charged on its own
        assert (a["budget"]["launches"], b["budget"]["launches"]) == (9, 8)

        # one more is refused by the policy, nothing charged, the staged launch kept
        ok("launch", "--name", "third", "--", "true")
        third = tool("sleep")
        assert third.returncode == 3, third.stdout + third.stderr
        assert (
            f"already 2 sleeps in flight (max_sleeps_in_flight 2): '{a['id']}' (seq {a['sleep_seq']}), "
            f"'{b['id']}' (seq {b['sleep_seq']})" in third.stderr
        )
        ok("unstage")

        status = ok("status")
        assert "In flight: 2 sleeps (this workspace may have 2 at once):" in status
        assert f"  {a['id']} (#{a['sleep_seq']}) " in status
        assert f"The tasks below are sleep {b['id']}'s" in status
        assert "quick[0]" in status
        assert "slow[0]" in ok("status", "--sleep", a["id"])

        # both tasks started: tail finds each launch in the sleep that has it
        wait_for(lambda: "slow-started" in ok("tail", "slow"), 30, "slow's first line")
        assert f"slow[0] of sleep {a['id']}" in ok("tail", "slow")
        wait_for(lambda: "quick-started" in ok("tail", "quick", "--sleep", b["id"]), 30, "quick's first line")

        queue = json.loads(ok("queue", "--json"))
        assert sorted((j["launch"], j["sleep"]) for j in queue["jobs"]) == [
            ("quick", b["id"]),
            ("slow", a["id"]),
        ]
        assert f"slow[0] of {a['id']}" in ok("queue")

        # the operator's status lists both (once the kernel has recorded both tasks running)
        def operator_view() -> list[tuple[str, str]]:
            mine = json.loads(kernel.cli("status", "--json").stdout)["workspaces"][0]
            return [(s["id"], s["state"]) for s in mine["in_flight"]]

        both = [(a["id"], "running"), (b["id"], "running")]
        wait_for(
            lambda: operator_view() == both, 30, "both sleeps running in the operator's status", step=0.2
        )
        shown = kernel.cli("status").stdout
        assert f"    sleep {a['id']} (seq {a['sleep_seq']}): running; 1 RUNNING" in shown
        assert f"    sleep {b['id']} (seq {b['sleep_seq']}): running; 1 RUNNING" in shown

        which = tool("cancel")
        assert which.returncode == 3, which.stdout + which.stderr
        assert f"2 sleeps are in flight: '{a['id']}' (seq {a['sleep_seq']}), '{b['id']}'" in which.stderr
        assert "`python3 .syscall/syscall cancel --sleep ID [NAME...]` names one of them." in which.stderr

        # the second sleep wakes first: `wait` without an id shows its wake, then the other's
        gate_b.touch()
        first = ok("wait", "--timeout", "60")
        assert f"wakes/{b['id']}.md" in first, first
        assert (
            f"Not shown yet: the wake of your sleep {a['id']}; `python3 .syscall/syscall wait` shows the next."
            in first
        )
        gate_a.touch()
        second = ok("wait", "--timeout", "60")
        assert f"wakes/{a['id']}.md" in second, second
        assert "Not shown yet" not in second

        wake_a = json.loads((ws / ".syscall" / "wakes" / f"{a['id']}.json").read_bytes())
        wake_b = json.loads((ws / ".syscall" / "wakes" / f"{b['id']}.json").read_bytes())
        assert [(t["launch"], t["state"]) for t in wake_a["tasks"]] == [("slow", "COMPLETED")]
        assert [(t["launch"], t["state"]) for t in wake_b["tasks"]] == [("quick", "COMPLETED")]
        assert wake_a["snapshot"]  # each sleep its own snapshot of the workspace
        assert wake_b["snapshot"]
        results = ws / ".syscall" / "results"
        assert "slow-done" in (results / str(a["sleep_seq"]) / "slow" / "stdout").read_text()
        assert "quick-done" in (results / str(b["sleep_seq"]) / "quick" / "stdout").read_text()
        final = json.loads(ok("budget", "--json"))["budget"]
        assert (final["sleeps"], final["launches"], final["reserved_gpu_hours"]) == (8, 8, 0)
        assert kernel.stop() == 0
    finally:
        gate_a.touch()
        gate_b.touch()
        kernel.ensure_stopped()
