"""Issue 13: one workspace's heavy work that does not return (a hung filesystem) stalls that workspace only, and
shows in `syscall-kernel status` (a real kernel process, real directories, real jobs).

The test-only hang point `launches` (kernel.io.crash.hang_point, driven by SYSCALL_KERNEL_HANG_CHANNEL) blocks the
writing of workspace A's run directories where a hung filesystem would. Meanwhile workspace B's sleep must be
dispatched and woken, A's hung work must show in `status` once past `heavy_io_deadline_seconds`, and once it
returns A's sleep is woken and the problem clears. On the old kernel that write ran on a plain thread: outside the
heavy pool, with no deadline, so nothing ever said why A stalled (and nothing kept A to one heavy job at a time).

`jail = "none"`: the jobs only write a file (the jail has its own tests).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from kernelproc import (
    Kernel,
    git_workspace,
    make_workspace,
    put_request,
    read_answer,
    status,
    wait_answer,
    wait_for,
)

from channel.paths import workspace_key

OVERDUE = "heavy work (snapshot, artifact copy, wake) has not returned"


def sleep_request(rid: str, command: str) -> dict[str, Any]:
    launch = {"name": "make", "command": command, "artifacts": ["out.txt"], "minutes": 10}
    return {"protocol": 1, "id": rid, "type": "sleep", "launches": [launch]}


def test_a_workspace_whose_heavy_work_hangs_holds_no_other_workspace(tmp_path: Path) -> None:
    k = Kernel(
        tmp_path,
        'jail = "none"\nheavy_io_deadline_seconds = 1\nrescan_seconds = 1\npoll_seconds = 0.2\n',
    )
    a = git_workspace(tmp_path / "a")
    b = git_workspace(tmp_path / "b")
    k.enroll(a)
    k.enroll(b)
    key_a = workspace_key(str(a.resolve()))
    hang = tmp_path / "hang"
    k.start(env={"SYSCALL_KERNEL_HANG_CHANNEL": str(hang)})
    try:
        hang.write_text(f"launches {a.resolve()}")
        put_request(a, "sa", sleep_request("sa", "echo a > out.txt"))
        k.wait_log("event=hang_injected step=launches", 30)

        # B's sleep is dispatched and woken while A's run directories do not return.
        put_request(b, "sb", sleep_request("sb", "echo b > out.txt"))
        wake_b = b / ".syscall" / "wakes" / "sb.json"
        wait_for(wake_b.exists, 30, "B's wake while A's heavy work hangs")
        assert json.loads(wake_b.read_text())["tasks"][0]["state"] == "COMPLETED"

        def problem_shown() -> str | None:
            out = k.cli("status").stdout
            return out if OVERDUE in out else None

        shown = wait_for(problem_shown, 15, "A's overdue heavy work in syscall-kernel status")
        assert key_a in shown
        assert f"event=heavy_overdue ws={key_a} " in k.log_text()
        assert not (a / ".syscall" / "wakes" / "sa.json").exists()

        # The filesystem answers again: A's sleep goes on to its wake and the problem clears.
        hang.unlink()
        wake_a = a / ".syscall" / "wakes" / "sa.json"
        wait_for(wake_a.exists, 30, "A's wake once its filesystem answers")
        assert json.loads(wake_a.read_text())["tasks"][0]["state"] == "COMPLETED"
        k.wait_log(f"event=heavy_returned ws={key_a}", 15)
        wait_for(lambda: OVERDUE not in k.cli("status").stdout, 15, "the problem cleared")
        assert k.log_text().count(f"event=heavy_overdue ws={key_a} ") == 1, "logged once"
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def test_the_heavy_deadline_is_live_on_sighup(tmp_path: Path) -> None:
    """`heavy_io_deadline_seconds` changes on SIGHUP (the old kernel kept it until a restart: `reload_kept`): a
    kernel started with the default 300 s, told 1 s by a reload, shows A's hung heavy work within seconds."""
    k = Kernel(tmp_path, 'jail = "none"\nrescan_seconds = 1\npoll_seconds = 0.2\n')
    a = git_workspace(tmp_path / "a")
    k.enroll(a)
    key_a = workspace_key(str(a.resolve()))
    hang = tmp_path / "hang"
    k.start(env={"SYSCALL_KERNEL_HANG_CHANNEL": str(hang)})
    try:
        assert k.proc is not None
        k.config.write_text(k.config.read_text() + "heavy_io_deadline_seconds = 1\n")
        k.proc.send_signal(signal.SIGHUP)
        k.wait_log("event=reloaded", 10)
        log = k.log_text()
        assert "event=reload_kept key=heavy_io_deadline_seconds" not in log
        assert "changed=heavy_io_deadline_seconds" in log

        hang.write_text(f"launches {a.resolve()}")
        put_request(a, "sa", sleep_request("sa", "echo a > out.txt"))
        k.wait_log("event=hang_injected step=launches", 30)
        shown = wait_for(
            lambda: out if OVERDUE in (out := k.cli("status").stdout) else None,
            15,
            "A's heavy work overdue after the reloaded deadline",
        )
        assert key_a in shown
        assert "has not returned after 1 s" in shown
        k.wait_log(f"event=heavy_overdue ws={key_a} ", 5)
        hang.unlink()
        wait_for((a / ".syscall" / "wakes" / "sa.json").exists, 30, "A's wake once its filesystem answers")
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def test_a_submits_protected_path_diff_that_hangs_holds_no_other_workspace(tmp_path: Path) -> None:
    """A submit's candidate tree is compared with its base (`git diff-tree` in the kernel's repository of the
    workspace) before its plan is decided. The old kernel ran that git process on the store worker, so while it
    hung every workspace's `status` waited; now it is A's heavy work (hang point `diff`): B is answered, A's
    problem shows in `status`, and A's submit goes on once the comparison returns."""
    k = Kernel(
        tmp_path, 'jail = "none"\nheavy_io_deadline_seconds = 1\nrescan_seconds = 1\npoll_seconds = 0.2\n'
    )
    a = make_workspace(tmp_path / "a", {"eval.sh": "cat result.txt\n", "result.txt": '{"score": 0.5}\n'})
    b = git_workspace(tmp_path / "b")
    k.enroll(a, "--eval-command", "sh eval.sh", "--metric", "score", "--protected", "eval.sh")
    k.enroll(b)
    key_a = workspace_key(str(a.resolve()))
    (a / "result.txt").write_text('{"score": 0.75}\n')
    hang = tmp_path / "hang"
    k.start(env={"SYSCALL_KERNEL_HANG_CHANNEL": str(hang)})
    try:
        hang.write_text(f"diff {a.resolve()}")
        put_request(a, "k1", {"protocol": 1, "id": "k1", "type": "sleep", "submit": {"report": "r"}})
        k.wait_log("event=hang_injected step=diff", 30)

        for i in range(5):  # B is answered while A's comparison does not return
            t0 = time.monotonic()
            put_request(b, f"b{i}", status(f"b{i}"))
            assert wait_answer(b, f"b{i}", 5)["type"] == "status"
            assert time.monotonic() - t0 < 5
        shown = wait_for(
            lambda: out if OVERDUE in (out := k.cli("status").stdout) else None,
            15,
            "A's overdue comparison in syscall-kernel status",
        )
        assert key_a in shown
        assert read_answer(a, "k1") is None

        hang.unlink()
        wake = a / ".syscall" / "wakes" / "k1.json"
        wait_for(wake.exists, 60, "A's wake once the comparison returns")
        assert json.loads(wake.read_text())["verdict"]["outcome"] == "improved"
        k.wait_log(f"event=heavy_returned ws={key_a}", 15)
    finally:
        hang.unlink(missing_ok=True)
        k.stop()
