"""Contract changes told by the kernel (issue 25): the next answer or wake written to a workspace says what of its
contract changed since the last one, once, in its JSON and its markdown, and a restart neither repeats nor loses it.

A real kernel (the local backend, `jail = "none"`: this is the kernel's bookkeeping) and the agent's requests
written as files, as a client that is not the reference tool writes them (an MCP harness or the agent itself):
before, only the reference tool noticed a changed kernel.json, and nothing in an answer or wake said so.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from kernelproc import Kernel, make_workspace, put_request, run_tool, status, wait_answer, wait_for

SENTENCE = "This workspace's contract changed since the kernel's last answer or wake here: "


def kernel_json(ws: Path) -> dict[str, Any]:
    try:
        return json.loads((ws / ".syscall" / "kernel.json").read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_a_changed_contract_is_told_once_in_the_next_answer_and_the_next_wake(tmp_path: Path) -> None:
    go = tmp_path / "go"
    k = Kernel(
        tmp_path, 'jail = "none"\n[defaults]\nmax_minutes = 60\nmax_gpus = 0\nmax_concurrent_gpus = 0\n'
    )
    ws = make_workspace(tmp_path / "ws")
    k.enroll(ws, "--launches", "10", "--sleeps", "10", "--gpu-hours", "1")
    k.start()
    try:
        assert k.proc is not None
        n = iter(range(1, 100))

        def ask() -> dict[str, Any]:
            rid = f"q{next(n)}"
            put_request(ws, rid, status(rid))
            return wait_answer(ws, rid, 30)

        def reload(old: str, new: str, minutes: int) -> None:
            k.config.write_text(k.config.read_text().replace(old, new))
            assert k.proc is not None
            k.proc.send_signal(signal.SIGHUP)
            wait_for(
                lambda: kernel_json(ws).get("policy", {}).get("max_minutes") == minutes, 15, "kernel.json"
            )

        assert "contract_changed" not in ask()  # the first answer: nothing told before it
        # A sleep in flight across the changes: its task ends when the test says so.
        script = f"while [ ! -e {go} ]; do sleep 0.1; done"
        done = run_tool(
            ws, "launch", "--name", "hold", "--minutes", "5", "--", "sh", "-c", script, timeout=30
        )
        assert done.returncode == 0, done.stdout + done.stderr
        done = run_tool(ws, "sleep", "--json", timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr + k.log_text()[-2000:]
        sleep_id = json.loads(done.stdout)["id"]
        assert "contract_changed" not in json.loads(done.stdout)

        # SIGHUP lowers max_minutes: the next status says so, with the values; the one after it does not.
        reload("max_minutes = 60", "max_minutes = 30", 30)
        told = ask()
        assert told["contract_changed"] == {
            "text": SENTENCE + "policy.max_minutes 60 -> 30.",
            "changes": [{"key": "policy.max_minutes", "old": 60, "new": 30}],
        }, told
        assert "contract_changed" not in ask()

        # Changed again, and the kernel restarted before anything was written: the wake says it.
        reload("max_minutes = 30", "max_minutes = 45", 45)
        assert k.stop() == 0
        k.start()
        go.touch()
        md_path = ws / ".syscall" / "wakes" / f"{sleep_id}.md"
        wait_for(md_path.exists, 60, "the wake")
        wake = json.loads((ws / ".syscall" / "wakes" / f"{sleep_id}.json").read_text())
        assert wake["contract_changed"]["changes"] == [{"key": "policy.max_minutes", "old": 30, "new": 45}]
        md = md_path.read_text()
        assert f"**Contract changed.** {SENTENCE}policy.max_minutes 30 -> 45.\n" in md, md
        assert md.count("Contract changed") == 1

        # Told once: neither the next answer nor one after a restart says it again.
        assert "contract_changed" not in ask()
        assert k.stop() == 0
        k.start()
        assert "contract_changed" not in ask()
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
