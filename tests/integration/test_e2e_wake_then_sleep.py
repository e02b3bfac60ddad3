"""End to end: a wake the agent can read is over for the kernel (issue 25).

The agent (or an MCP harness) commits its next sleep the instant `wakes/<id>.md` appears. The kernel writes the
wake's files while the sleep is `gathered` and records `woken` just after; a next sleep decided in between must
not be refused with `sleep.in_progress`, whose message ("has not woken yet") would be false.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

from kernelproc import Kernel, make_workspace, put_request, wait_answer, wait_for

from channel.paths import workspace_key
from kernel.io.crash import CRASH_ENV

ROUNDS = 20


def sleep(rid: str) -> dict[str, object]:
    launches = [{"name": f"t{k}", "command": "true", "minutes": 5} for k in range(2)]
    return {"protocol": 1, "id": rid, "type": "sleep", "launches": launches}


def test_the_next_sleep_committed_the_instant_the_wake_appears_is_accepted(tmp_path: Path) -> None:
    kernel = Kernel(tmp_path, 'backend = "local"\njail = "none"\n')
    ws = make_workspace(tmp_path / "ws")
    kernel.enroll(ws, "--sleeps", str(ROUNDS + 5), "--launches", str(2 * ROUNDS + 10))
    kernel.start()
    try:
        wakes = ws / ".syscall" / "wakes"
        put_request(ws, "s0", sleep("s0"))
        refused = []
        for n in range(1, ROUNDS + 1):
            prev = wakes / f"s{n - 1}.md"
            deadline = time.monotonic() + 30
            while not os.path.exists(prev):  # no sleep between looks: the agent that reacts fastest
                assert time.monotonic() < deadline, f"no wake for s{n - 1}:\n{kernel.log_text()[-2000:]}"
            rid = f"s{n}"
            put_request(ws, rid, sleep(rid))
            ans = wait_answer(ws, rid, timeout=30)
            if ans["type"] != "accepted":
                refused.append((rid, ans))
                break
        assert not refused, f"a sleep committed after the previous wake was readable was refused: {refused}"
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def test_a_gathered_sleep_carries_its_wakes_woken_at(tmp_path: Path) -> None:
    # `status` and `history` answer from the store: a sleep whose wake is recorded (and may be read) shows as
    # woken, at the wake's own time, before `woken` is recorded (the kernel killed in between here)
    kernel = Kernel(tmp_path, 'backend = "local"\njail = "none"\n')
    ws = make_workspace(tmp_path / "ws")
    kernel.enroll(ws)
    try:
        kernel.start(env={CRASH_ENV: "gathered"})
        put_request(ws, "s0", sleep("s0"))
        assert kernel.proc is not None
        assert kernel.proc.wait(30) == -9
        kernel.ensure_stopped()
        db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
        try:
            key = workspace_key(ws.resolve())
            state, woken_at = db.execute(
                "SELECT state, woken_at FROM sleeps WHERE workspace=? AND id='s0'", (key,)
            ).fetchone()
            (stored,) = db.execute("SELECT wake_json FROM exec_sleeps WHERE workspace=?", (key,)).fetchone()
        finally:
            db.close()
        assert state == "gathered"
        assert woken_at == json.loads(stored)["woken_at"]
        kernel.start()
        wake = wait_for(lambda: (ws / ".syscall" / "wakes" / "s0.json").exists(), 30, "the wake")
        assert wake
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
