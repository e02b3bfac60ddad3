"""Spec 2.3 (issue 13 follow-up): the kernel checks each channel subdirectory against the (device, inode) it
recorded at enrollment. An agent that swaps `answers/` or `requests/` for another directory of its own stops
only its own workspace: a problem in `syscall-kernel status` and the log, nothing read from or written into
the new directory, its requests kept; `syscall-kernel enroll WS` adopts the new directory and they are answered.
Real directories, a real kernel process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kernelproc import Kernel, git_workspace, put_request, read_answer, status, wait_answer, wait_for

from channel.paths import workspace_key


@pytest.mark.parametrize("swapped", ["answers", "requests"])
def test_a_swapped_subdirectory_stops_only_its_workspace_until_enroll_adopts_it(
    tmp_path: Path, swapped: str
) -> None:
    k = Kernel(tmp_path, 'backend = "none"\npoll_seconds = 0.1\nrescan_seconds = 0.5\n')
    ws = git_workspace(tmp_path / "ws")
    other = git_workspace(tmp_path / "other")
    k.enroll(ws)
    k.enroll(other)
    k.start()
    try:
        put_request(ws, "before", status("before"))
        wait_answer(ws, "before")

        # The agent swaps the subdirectory for another real directory it owns.
        ch = ws / ".syscall"
        os.rename(ch / swapped, ch / f"{swapped}.old")
        (ch / swapped).mkdir()
        put_request(ws, "after", status("after"))
        key = workspace_key(str(ws.resolve()))
        k.wait_log("SubdirReplaced", 15)

        def problem_shown() -> str | None:
            out = k.cli("status").stdout
            return out if f"{swapped} was replaced since enrollment" in out else None

        shown = wait_for(problem_shown, 15, "the problem in syscall-kernel status")
        assert "syscall-kernel enroll" in shown

        # The other workspace is served meanwhile.
        put_request(other, "meanwhile", status("meanwhile"))
        wait_answer(other, "meanwhile")

        # Nothing was read from or written into the new directory, nor through the old one.
        time.sleep(1.5)  # three rescans
        assert (ch / "requests" / "after.json").exists()
        assert read_answer(ws, "after") is None
        assert not (ch / f"{swapped}.old" / "after.json").exists()
        assert key in (problem_shown() or "")

        # The operator checks the workspace and adopts the new directory: the kept request is answered.
        k.enroll(ws)
        assert wait_answer(ws, "after", 15)["type"] == "status"
        # The request is removed right after its answer is in place (a loaded machine widens the gap).
        wait_for(lambda: not (ch / "requests" / "after.json").exists(), 10, "the answered request removed")
        wait_for(lambda: "was replaced" not in k.cli("status").stdout, 15, "the problem cleared")
    finally:
        k.stop()
