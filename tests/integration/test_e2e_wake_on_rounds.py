"""The next sleep committed the instant an early wake appears, many rounds (issue 25's rule: once a wake is
readable, no later answer treats that sleep as not woken unless it literally is still running).

Raw protocol, a real kernel (local backend, `jail = "none"`: the slow tasks wait for a gate file outside their
tree, so they are still running when each early wake is read, by the test's choice, never a race). With room in
flight, each next sleep is accepted; with `max_sleeps_in_flight` 1 it is refused, and the refusal says the sleep
woke early and still runs a task, never that it has not woken. Then every rest is delivered once and the budget
is exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kernelproc import Kernel, make_workspace, put_request, wait_answer, wait_for

ROUNDS = 6


def request(rid: str, gate: Path) -> dict[str, Any]:
    return {
        "protocol": 1,
        "id": rid,
        "type": "sleep",
        "wake_on": "first-failure",
        "launches": [
            {"name": "fail", "command": "exit 1"},
            {"name": "slow", "command": f"while [ ! -e {gate} ]; do sleep 0.05; done"},
        ],
    }


def test_the_next_sleep_committed_the_instant_each_early_wake_appears(tmp_path: Path) -> None:
    kernel = Kernel(tmp_path, 'jail = "none"\n[local]\nmax_parallel = 32\n')  # every slow task holds a slot
    roomy = make_workspace(tmp_path / "roomy")
    tight = make_workspace(tmp_path / "tight")
    kernel.enroll(roomy, "--launches", "40", "--sleeps", "20", "--max-sleeps-in-flight", str(ROUNDS + 1))
    kernel.enroll(tight, "--launches", "40", "--sleeps", "20", "--max-sleeps-in-flight", "1")
    kernel.start()
    gate = tmp_path / "gate"
    try:
        for ws in (roomy, tight):
            put_request(ws, "r0", request("r0", gate))
            assert wait_answer(ws, "r0", 30)["type"] == "accepted"
        for i in range(1, ROUNDS + 1):
            prev, rid = f"r{i - 1}", f"r{i}"
            # the tight workspace's r0 is in flight all along: each of its next sleeps is refused
            for ws, seen in ((roomy, prev), (tight, "r0")):
                wait_for((ws / ".syscall" / "wakes" / f"{seen}.md").exists, 60, f"the early wake of {seen}")
                put_request(ws, rid, request(rid, gate))  # the instant it is readable
            ans = wait_answer(roomy, rid, 30)
            assert ans["type"] == "accepted", ans
            refused = wait_answer(tight, rid, 30)
            assert refused["type"] == "rejected", refused
            assert refused["error"]["code"] == "sleep.in_progress"
            msg = refused["error"]["message"]
            assert "'r0' (seq 1; woke early, 1 task of it still running)" in msg, msg
            assert "has not woken" not in msg
            early = json.loads((roomy / ".syscall" / "wakes" / f"{prev}.json").read_bytes())
            assert early["part"] == "early", early
        wait_for((roomy / ".syscall" / "wakes" / f"r{ROUNDS}.md").exists, 60, "the last early wake")
        gate.touch()
        for ws, last in ((roomy, ROUNDS), (tight, 0)):
            for i in range(last + 1):
                wait_for((ws / ".syscall" / "wakes" / f"r{i}.rest.md").exists, 60, f"the rest of r{i}")
        wait_for(lambda: kernel.log_text().count("event=woken ") == ROUNDS + 2, 30, "every sleep woken")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    log = kernel.log_text()
    assert log.count("event=woken_early ") == ROUNDS + 2
    assert log.count("event=gathered_early ") == ROUNDS + 2
    for ws, n in ((roomy, ROUNDS + 1), (tight, 1)):
        budget = json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]
        assert (budget["sleeps"], budget["launches"], budget["reserved_gpu_hours"]) == (20 - n, 40 - 2 * n, 0)
        names = sorted(os.listdir(ws / ".syscall" / "wakes"))
        assert names == sorted(f"r{i}.{x}" for i in range(n) for x in ("json", "md", "rest.json", "rest.md"))
