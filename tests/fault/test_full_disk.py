"""A full state disk (issue 12, defect 4): a 2 MB tmpfs state dir filled, then freed.

The kernel used to crash (and crash-loop at every start) on `database or disk is full`. Now a failed store write
is logged at err, nothing it did not record is answered, `status` and STATUS= say `degraded`, the kernel stays up,
and once space returns every request is answered exactly once, without a restart.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernelproc import Kernel, git_workspace, put_request, read_answer, status, wait_for
from testenv import fill, tmpfs


@pytest.fixture
def tmpfs_state(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "kernel" / "state", "2m") as state:
        yield state


def test_a_full_state_disk_degrades_and_recovers_without_losing_or_repeating(
    tmp_path: Path, tmpfs_state: Path
) -> None:
    k = Kernel(tmp_path, 'backend = "none"\nrescan_seconds = 0.5\n')
    assert k.state == tmpfs_state
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    k.start()
    try:
        filler = tmpfs_state / "filler"
        fill(filler)
        # sqlite may still have room in its WAL: send requests until a write fails.
        sent: list[str] = []
        for i in range(400):
            rid = f"r{i}"
            put_request(ws, rid, status(rid))
            sent.append(rid)
            wait_for(
                lambda rid=rid: (
                    read_answer(ws, rid) is not None or "event=store_write_failed" in k.log_text()
                ),
                10,
                f"an answer to {rid} or a failed write",
            )
            if "event=store_write_failed" in k.log_text():
                break
        log = k.log_text()
        assert "event=store_write_failed" in log, "the disk never filled"
        assert "ERROR event=store_write_failed" in log
        assert "disk is full" in log
        unanswered = [r for r in sent if read_answer(ws, r) is None]
        assert unanswered, "every request was answered although its write failed"
        # The kernel stays up and says it is degraded (systemd's STATUS= gets the same line).
        wait_for(
            lambda: (json.loads(k.cli("status", "--json").stdout)["kernel_status"] or "").startswith(
                "degraded"
            ),
            15,
            "status to say degraded",
        )
        assert k.proc is not None
        assert k.proc.poll() is None
        for r in unanswered:
            assert read_answer(ws, r) is None

        # Space returns: everything is answered, once, without a restart.
        filler.unlink()
        for r in sent:
            wait_for(lambda r=r: read_answer(ws, r), 20, f"the answer to {r} after space returned")
        k.wait_log("event=store_recovered", 10)
        wait_for(
            lambda: (
                not (json.loads(k.cli("status", "--json").stdout)["kernel_status"] or "").startswith(
                    "degraded"
                )
            ),
            15,
            "status to stop saying degraded",
        )
        log = k.log_text()
        for r in sent:
            assert log.count(f" id={r} ") == 1, r
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
    # What was answered is exactly what the store recorded.
    db = sqlite3.connect(f"file:{k.state / 'state.sqlite'}?mode=ro", uri=True)
    recorded = dict(db.execute("SELECT id, answer FROM requests").fetchall())
    db.close()
    for r in sent:
        assert (ws / ".syscall" / "answers" / f"{r}.json").read_bytes() == recorded[r]


def test_a_state_dir_that_is_a_file_or_has_no_parent_is_a_clear_error(tmp_path: Path) -> None:
    k = Kernel(tmp_path)
    k.state.write_text("not a directory\n")
    out = k.cli("serve", check=False)
    assert out.returncode == 2
    assert f"state_dir {k.state} is not a directory (it is a file)" in out.stderr
    assert "Traceback" not in out.stderr
    deep = tmp_path / "no" / "such" / "state"
    k.config.write_text(k.config.read_text().replace(f'state_dir = "{k.state}"', f'state_dir = "{deep}"'))
    out = k.cli("serve", check=False)
    assert out.returncode == 2
    assert "neither does its parent" in out.stderr
    assert not (tmp_path / "no").exists()
    out = k.cli("enroll", str(git_workspace(tmp_path / "ws")), check=False)
    assert out.returncode == 1
    assert not (tmp_path / "no").exists()


def test_serve_as_root_is_refused_unless_allowed(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    k = Kernel(tmp_path)
    k.config.write_text(k.config.read_text().replace("allow_root = true\n", ""))
    out = k.cli("serve", check=False)
    assert out.returncode == 2
    assert "refusing to run as root" in out.stderr
    assert not k.state.exists()
