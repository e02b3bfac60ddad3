"""Retention on a real kernel: `retention_sleeps = 1` prunes older sleeps' run directories, delivered results and
request bodies on the kernel's own schedule (a look at start), keeps every wake, never touches a sleep in flight,
and never follows a link the agent put in `results/`. `status` shows the disk used and what was pruned.

`jail = "none"`: a job waits on a file outside its tree (the jail has its own tests).
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from kernelproc import Kernel, git_workspace, put_request, read_answer, wait_for

from channel.paths import workspace_key


def sleep_request(rid: str, command: str) -> dict[str, Any]:
    launch = {"name": "make", "command": command, "artifacts": ["out.txt"], "minutes": 10}
    return {"protocol": 1, "id": rid, "type": "sleep", "launches": [launch]}


def test_retention_prunes_old_evidence_keeps_wakes_and_live_sleeps_and_follows_no_link(
    tmp_path: Path,
) -> None:
    kernel = Kernel(tmp_path, 'jail = "none"\nretention_sleeps = 1\nrescan_seconds = 1\n')
    ws = git_workspace(tmp_path / "ws")
    key = workspace_key(ws.resolve())
    ch = ws / ".syscall"
    runs = kernel.state / "runs" / key
    marks = tmp_path / "marks"
    marks.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("not the kernel's to delete\n")
    kernel.enroll(ws, "--launches", "10", "--sleeps", "10")
    try:
        kernel.start()
        for i in (1, 2, 3):
            put_request(ws, f"s{i}", sleep_request(f"s{i}", f"echo made-{i} > out.txt"))
            kernel.wait_log(f"event=woken ws={key} seq={i} ", 60)  # woken in the store: the next may come
        # Before any pruning look: every sleep's evidence is there.
        assert sorted(p.name for p in runs.iterdir()) == ["1", "2", "3"]
        assert (ch / "results" / "1" / "make" / "out.txt").read_text() == "made-1\n"
        # The agent swaps results/2 for a link to a directory the kernel must not empty.
        os.rename(ch / "results" / "2", tmp_path / "moved-2")
        os.symlink(outside, ch / "results" / "2")
        # A fourth sleep is in flight across the restart.
        put_request(
            ws, "s4", sleep_request("s4", f"while [ ! -e {marks}/go ]; do sleep 0.05; done; echo 4 > out.txt")
        )
        assert wait_for(lambda: read_answer(ws, "s4"), 30, "the answer to s4")["type"] == "accepted"
        wait_for((runs / "4" / "make" / "started").exists, 30, "s4's job to start")
        assert kernel.stop() == 0

        kernel.start()  # retention looks at start
        kernel.wait_log("event=pruned", 30, count=2)
        status = json.loads(kernel.cli("status", "--json").stdout)
        (marks / "go").touch()
        wait_for((ch / "wakes" / "s4.json").exists, 60, "the wake of s4 (in flight while pruning)")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        (marks / "go").touch()

    log = kernel.log_text()
    assert f"event=pruned ws={key} seq=1 " in log
    assert f"event=pruned ws={key} seq=2 " in log
    assert "seq=3 " not in "".join(line for line in log.splitlines() if "event=pruned" in line)
    # Sleeps 1 and 2 lost their run directories and results; 3 (the newest woken one) and 4 (in flight) kept all.
    assert sorted(p.name for p in runs.iterdir()) == ["3", "4"]
    assert sorted(p.name for p in (ch / "results").iterdir()) == ["3", "4"]
    assert (ch / "results" / "3" / "make" / "out.txt").read_text() == "made-3\n"
    assert json.loads((ch / "wakes" / "s4.json").read_text())["tasks"][0]["state"] == "COMPLETED"
    # The link was removed as a link: what it pointed at is untouched.
    assert (outside / "precious.txt").read_text() == "not the kernel's to delete\n"
    # Every wake stays.
    assert sorted(p.name for p in (ch / "wakes").iterdir() if p.suffix == ".json") == [
        "s1.json",
        "s2.json",
        "s3.json",
        "s4.json",
    ]
    [w] = status["workspaces"]
    assert w["pruned_sleeps"] == 2
    assert w["run_bytes"] > 0
    assert w["result_bytes"] >= len("made-3\n")
    db = sqlite3.connect(f"file:{kernel.state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        bodies = dict(db.execute("SELECT id, body IS NOT NULL FROM requests WHERE type='sleep'").fetchall())
        answers = dict(
            db.execute("SELECT id, answer IS NOT NULL FROM requests WHERE type='sleep'").fetchall()
        )
    finally:
        db.close()
    # The pruned sleeps' request bodies are gone; their ids and answers stay (a replay is answered the same).
    assert bodies == {"s1": 0, "s2": 0, "s3": 1, "s4": 1}
    assert answers == {"s1": 1, "s2": 1, "s3": 1, "s4": 1}


def test_a_workspace_past_its_run_directory_cap_loses_its_oldest_woken_sleeps(tmp_path: Path) -> None:
    """`retention_run_mb = 1` (retention_sleeps and retention_days unset: they would keep everything): three
    sleeps each leave ~600 KiB in the run directory; at the next look the two oldest are pruned, the newest kept,
    and another workspace under the cap is untouched."""
    kernel = Kernel(tmp_path, 'jail = "none"\nretention_run_mb = 1\n')
    big, small = git_workspace(tmp_path / "big"), git_workspace(tmp_path / "small")
    keys = {ws.name: workspace_key(ws.resolve()) for ws in (big, small)}
    for ws in (big, small):
        kernel.enroll(ws, "--launches", "10", "--sleeps", "10")
    try:
        kernel.start()
        for i in (1, 2, 3):
            put_request(big, f"s{i}", sleep_request(f"s{i}", "head -c 600000 /dev/zero > out.txt"))
            kernel.wait_log(f"event=woken ws={keys['big']} seq={i} ", 60)
        put_request(small, "t1", sleep_request("t1", "echo small > out.txt"))
        kernel.wait_log(f"event=woken ws={keys['small']} seq=1 ", 60)
        assert kernel.stop() == 0
        kernel.start()  # retention looks at start
        kernel.wait_log("event=pruned", 30, count=2)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    runs = kernel.state / "runs"
    assert sorted(p.name for p in (runs / keys["big"]).iterdir()) == ["3"]
    assert sorted(p.name for p in (runs / keys["small"]).iterdir()) == ["1"]
    pruned = [line for line in kernel.log_text().splitlines() if "event=pruned" in line]
    assert [f"ws={keys['big']} seq={n} " in line for n, line in zip((1, 2), pruned, strict=True)] == [
        True,
        True,
    ]
    assert (big / ".syscall" / "wakes" / "s1.json").exists()  # every wake stays
