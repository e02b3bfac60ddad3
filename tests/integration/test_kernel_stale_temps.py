"""A real kernel process ages out abandoned `requests/.<id>.tmp` files (spec 3.1) and touches nothing younger.

Ages are set with `os.utime` before the kernel starts, so the default grace (10 minutes) is what is tested and
nothing waits for a clock.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernelproc import Kernel, git_workspace, put_request, status, wait_answer, wait_for


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(tmp_path, 'rescan_seconds = 2\nbackend = "none"\n')
    yield k
    k.ensure_stopped()


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def removal_counts(kernel: Kernel, ws: Path) -> list[tuple[int, int, int]]:
    """(count, young, left) of every `temps_removed` line of the workspace `ws`."""
    return [
        (int(m[1]), int(m[2]), int(m[3]))
        for m in re.finditer(
            rf"event=temps_removed ws={re.escape(ws.name)}-\S+ count=(\d+) young=(\d+) left=(\d+)",
            kernel.log_text(),
        )
    ]


def test_old_temps_go_young_ones_and_link_targets_stay(kernel: Kernel, tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    kernel.enroll(ws)
    rq = ws / ".syscall" / "requests"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    age(victim, 7200)
    (rq / ".old.tmp").write_text('{"protocol": 1, "id": "old"')
    age(rq / ".old.tmp", 11 * 60)
    (rq / ".nine-minutes.tmp").write_text('{"protocol": 1')
    age(rq / ".nine-minutes.tmp", 9 * 60)
    (rq / ".fresh.tmp").write_text("")
    (rq / ".old-link.tmp").symlink_to(victim)
    age(rq / ".old-link.tmp", 3600)
    (rq / ".fresh-link.tmp").symlink_to(victim)  # its target is old; the link is not
    (rq / ".old-dir.tmp").mkdir()
    age(rq / ".old-dir.tmp", 3600)
    (rq / ".full-dir.tmp").mkdir()
    (rq / ".full-dir.tmp" / "x").write_text("agent's")
    age(rq / ".full-dir.tmp", 3600)

    kernel.start()
    kernel.wait_log("event=temps_removed", 10)
    assert removal_counts(kernel, ws) == [(3, 3, 1)]
    assert sorted(os.listdir(rq)) == [".fresh-link.tmp", ".fresh.tmp", ".full-dir.tmp", ".nine-minutes.tmp"]
    assert victim.read_text() == "keep me"
    assert (rq / ".full-dir.tmp" / "x").read_text() == "agent's"

    # A client's write in progress is never disturbed: it still commits and is answered.
    with open(rq / ".late.tmp", "wb") as f:
        f.write(b'{"protocol": 1, "id": "late", "type": "status"}')
    os.rename(rq / ".late.tmp", rq / "late.json")
    assert wait_answer(ws, "late")["type"] == "status"
    # Nothing young was removed by the listings since (one line only, from the start).
    assert removal_counts(kernel, ws) == [(3, 3, 1)]
    assert kernel.stop() == 0


def test_ten_thousand_stale_temps_are_cleared_in_bounded_passes_without_stalling_others(
    kernel: Kernel, tmp_path: Path
) -> None:
    n = int(os.environ.get("SYSCALL_TEST_FLOOD", "10000"))
    bad = git_workspace(tmp_path / "bad")
    good = git_workspace(tmp_path / "good")
    kernel.enroll(bad)
    kernel.enroll(good)
    rq = bad / ".syscall" / "requests"
    past = time.time() - 3600
    for i in range(n):
        path = rq / f".f{i:05d}.tmp"
        path.write_bytes(b"{")
        os.utime(path, (past, past))
    kernel.start()

    for attempt in range(3):
        rid = f"good-{attempt}"
        started = time.monotonic()
        put_request(good, rid, status(rid))
        wait_answer(good, rid, timeout=2.0)
        assert time.monotonic() - started < 2.0

    wait_for(lambda: not os.listdir(rq), 60, "the stale temps to be cleared")
    counts = removal_counts(kernel, bad)
    assert sum(c for c, _, _ in counts) == n
    assert max(c for c, _, _ in counts) <= 256, "more than one bounded batch in a listing"
    assert len(counts) >= n // 256
    assert kernel.stop() == 0
