"""Issue 13: one workspace's channel I/O never holds another's answers (a real kernel process, real directories).

A hung network filesystem cannot be mounted here, so the test-only hang point (`kernel.io.crash.hang_point`,
driven by SYSCALL_KERNEL_HANG_CHANNEL) blocks workspace A's channel I/O where a hung filesystem would: at any
channel call, or inside a full listing of `requests/` (a huge or slow directory, isolation case c). Meanwhile
workspace B's `status` requests must be answered, A's problem must show in `syscall-kernel status` once its I/O
is past `channel_io_deadline_seconds`, and once the I/O returns A's request is answered and the problem clears.
On the old kernel every channel call ran on the one store worker, so B waited for A.

The same scenarios without a kernel process (a hung admission, a look at a workspace enrolled meanwhile, a lost
watch's re-watch, a full listing, the after-`ready` refresh) are tests/unit/test_serving_driver.py: the same
driver, pools and hang point in process, with a 0.3 s deadline. Those left here are end to end: the CLI's
`status`, SIGTERM, another process holding a lock, the enrollment's globs and syncs."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

import pytest
from kernelproc import Kernel, git_workspace, put_request, read_answer, status, wait_answer, wait_for

from channel.paths import workspace_key

OVERDUE = "channel I/O has not returned since"
FAST = 'backend = "none"\nchannel_io_deadline_seconds = 1\nrescan_seconds = 1\npoll_seconds = 0.2\n'


def kernel_with(tmp_path: Path, *names: str, config: str = FAST) -> tuple[Kernel, list[Path], Path]:
    """A kernel (not started) with a git workspace enrolled for each name, and the hang file to name in
    SYSCALL_KERNEL_HANG_CHANNEL (`hang_env`): while it holds "STEP PATH", that workspace's channel I/O hangs at
    STEP."""
    k = Kernel(tmp_path, config)
    workspaces = [git_workspace(tmp_path / name) for name in names]
    for ws in workspaces:
        k.enroll(ws)
    return k, workspaces, tmp_path / "hang"


def hang_env(hang: Path) -> dict[str, str]:
    return {"SYSCALL_KERNEL_HANG_CHANNEL": str(hang)}


def assert_served_meanwhile(b: Path) -> None:
    """B is answered, again and again, each within 5 s (the old kernel answered nothing while A's I/O hung)."""
    for i in range(10):
        t0 = time.monotonic()
        put_request(b, f"b{i}", status(f"b{i}"))
        assert wait_answer(b, f"b{i}", 5)["type"] == "status"
        assert time.monotonic() - t0 < 5
        time.sleep(0.2)


def assert_stops_within(k: Kernel, seconds: float) -> None:
    """SIGTERM: the kernel exits 0 within `seconds` (a hung channel's thread is left behind, not waited for)."""
    t0 = time.monotonic()
    assert k.stop(timeout=20) == 0
    assert time.monotonic() - t0 < seconds


def assert_answered_at_the_next_start(k: Kernel, hang: Path, a: Path, rid: str) -> None:
    """`rid`, unanswered while A hung, is answered by the next start once A's channel answers again."""
    assert read_answer(a, rid) is None
    hang.unlink()
    k.start()
    assert wait_answer(a, rid, 15)["type"] == "status"


def test_a_workspace_whose_channel_io_hangs_holds_no_other_workspace(tmp_path: Path) -> None:
    """A's next channel call hangs (its event starts it): B is served meanwhile, A's overdue I/O shows in
    `syscall-kernel status` (logged once) and clears once it returns. A hung full listing of requests/ is the
    in-process scenario tests/unit/test_serving_driver.py (the same driver and pools, without a kernel process)."""
    k, (a, b), hang = kernel_with(tmp_path, "a", "b")
    k.start(env=hang_env(hang))
    try:
        put_request(a, "before", status("before"))
        wait_answer(a, "before")

        hang.write_text(f"channel {a.resolve()}")
        put_request(a, "a1", status("a1"))  # its event starts A's next channel call: it hangs
        k.wait_log("event=hang_injected step=channel", 15)

        assert_served_meanwhile(b)
        assert "other workspaces are served meanwhile" in assert_overdue_shown(k, a)
        assert read_answer(a, "a1") is None, "A's I/O never returned, yet its request was answered"
        assert k.log_text().count("problem='channel I/O has not returned") == 1, "logged once"

        # The filesystem answers again: A's request is answered and its problem clears.
        hang.unlink()
        assert wait_answer(a, "a1", 15)["type"] == "status"
        k.wait_log("event=channel_io_returned", 15)
        wait_for(lambda: OVERDUE not in k.cli("status").stdout, 15, "the problem cleared")
        put_request(a, "after", status("after"))
        wait_answer(a, "after")
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def test_the_kernel_stops_while_a_channel_io_hangs(tmp_path: Path) -> None:
    """SIGTERM while A's channel I/O does not return: the stop waits at most the deadline for it, then leaves
    it to its (daemon) thread; the kernel exits 0 and A's request is answered after the next start."""
    k, (a,), hang = kernel_with(tmp_path, "a", config='backend = "none"\nchannel_io_deadline_seconds = 1\n')
    k.start(env=hang_env(hang))
    try:
        # The start's own turns at A (the sweep after `ready`, the refresh) are over before the hang is set: one
        # of them, past its hang point already, could otherwise list and answer a1.
        k.wait_log("event=channels_refreshed", 15)
        put_request(a, "before", status("before"))
        wait_answer(a, "before")
        hang.write_text(f"channel {a.resolve()}")
        put_request(a, "a1", status("a1"))
        k.wait_log("event=hang_injected", 15)
        assert_stops_within(k, 10)
        assert_answered_at_the_next_start(k, hang, a, "a1")
    finally:
        hang.unlink(missing_ok=True)
        k.ensure_stopped()


def problem_of(k: Kernel, ws: Path) -> str | None:
    """The problem `syscall-kernel status --json` shows for `ws`."""
    shown = json.loads(k.cli("status", "--json").stdout)
    problems: dict[str, str | None] = {w["path"]: w["problem"] for w in shown["workspaces"]}
    return problems[str(ws.resolve())]


def assert_overdue_shown(k: Kernel, a: Path) -> str:
    """A's overdue channel I/O is what `syscall-kernel status` says about A (and names A's key); the status
    text."""
    key = workspace_key(str(a.resolve()))

    def problem_shown() -> str | None:
        out = k.cli("status").stdout
        return out if OVERDUE in out else None

    shown = wait_for(problem_shown, 15, "A's overdue channel I/O in syscall-kernel status")
    assert key in shown
    assert OVERDUE in (problem_of(k, a) or "")
    return shown


def test_the_kernel_stops_while_a_channel_hangs_at_start_up_admission(tmp_path: Path) -> None:
    """SIGTERM after `ready` while A's admission has not returned: exit 0 promptly; A is admitted and its
    request answered at the next start. (That the start reaches `ready`, serves B, shows A's problem and serves
    A once its admission returns is the in-process scenario in tests/unit/test_serving_driver.py.)"""
    k, (a, b), hang = kernel_with(tmp_path, "a", "b")
    put_request(a, "a1", status("a1"))
    hang.write_text(f"admit {a.resolve()}")
    k.start(env=hang_env(hang), wait_ready=False)
    try:
        k.wait_log("event=ready", 20)
        put_request(b, "b1", status("b1"))
        assert wait_answer(b, "b1", 5)["type"] == "status"
        assert_stops_within(k, 5)
        assert_answered_at_the_next_start(k, hang, a, "a1")
    finally:
        hang.unlink(missing_ok=True)
        k.ensure_stopped()


def test_a_channel_that_hangs_in_the_rescans_look_holds_no_other_workspace(tmp_path: Path) -> None:
    """Issue 13: a channel the running kernel does not serve yet is looked at (checked, locked, its kernel files
    rewritten) when the rescan retries it (its lock was held by another process). A's channel hangs in that look
    (the test-only hang point `look`): B must still be answered, again and again, A's overdue I/O shows in
    `syscall-kernel status`, and A is served once its channel answers. On the old kernel the look ran on the
    store worker, so the service loop and every answer waited behind A. (A look at a workspace the poll tick
    sees enrolled meanwhile is the in-process scenario in tests/unit/test_serving_driver.py.)"""
    k, (a, b), hang = kernel_with(tmp_path, "a", "b")
    # Another process holds A's channel lock: not served, retried at every rescan.
    locker = os.open(a / ".syscall", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(locker, fcntl.LOCK_EX)
    held = True
    k.start(env=hang_env(hang))
    try:
        put_request(b, "before", status("before"))
        wait_answer(b, "before")
        hang.write_text(f"look {a.resolve()}")
        k.wait_log("event=channel_held_elsewhere", 10)
        os.close(locker)
        held = False
        k.wait_log("event=hang_injected step=look", 15)
        put_request(a, "a1", status("a1"))

        assert_served_meanwhile(b)
        assert_overdue_shown(k, a)
        assert read_answer(a, "a1") is None, "A's look never returned, yet its request was answered"

        hang.unlink()
        assert wait_answer(a, "a1", 15)["type"] == "status"
        wait_for(lambda: problem_of(k, a) is None, 15, "A's problem cleared")
        assert_served_meanwhile(b)
        hang.write_text(f"look {a.resolve()}")  # served now: no look at A any more, nothing hangs
        assert_stops_within(k, 5)
    finally:
        if held:
            os.close(locker)
        hang.unlink(missing_ok=True)
        k.ensure_stopped()


def test_the_kernel_stops_while_a_channel_hangs_in_the_rescans_look(tmp_path: Path) -> None:
    """SIGTERM while the poll tick's look at a newly enrolled A has not returned: exit 0 promptly."""
    k, (b,), hang = kernel_with(tmp_path, "b")
    a = git_workspace(tmp_path / "a")
    k.start(env=hang_env(hang))
    try:
        hang.write_text(f"look {a.resolve()}")
        k.enroll(a)
        k.wait_log("event=hang_injected step=look", 15)
        put_request(b, "b1", status("b1"))
        assert wait_answer(b, "b1", 5)["type"] == "status"
        assert_stops_within(k, 5)
    finally:
        hang.unlink(missing_ok=True)
        k.ensure_stopped()


# --- enrollment and re-watches: no filesystem work on the store worker ----------------------------------------


def glob_kernel(tmp_path: Path, config: str = FAST) -> tuple[Kernel, Path, Path, Path]:
    """A kernel (not started) whose `workspaces` glob is `<tmp>/spaces/*` (nothing there yet), with B enrolled
    outside it; (kernel, the glob's directory, B, the hang file)."""
    root = tmp_path / "spaces"
    root.mkdir()
    k = Kernel(tmp_path, f'{config}workspaces = ["{root}/*"]\n')
    b = git_workspace(tmp_path / "b")
    k.enroll(b)
    return k, root, b, tmp_path / "hang"


def enrolled_paths(k: Kernel) -> list[str]:
    """The paths of the kernel log's `enrolled` events (the service's own enrollments), in order."""
    return [
        line.split(" path=", 1)[1].split()[0]
        for line in k.log_text().splitlines()
        if "event=enrolled " in line
    ]


def assert_served_when_enrolled(k: Kernel, ws: Path, rid: str) -> None:
    """`ws`, a new glob match, gets its channel and answers `rid` within seconds, enrolled exactly once."""
    wait_for(lambda: (ws / ".syscall" / "requests").is_dir(), 15, f"{ws.name}'s channel")
    put_request(ws, rid, status(rid))
    assert wait_answer(ws, rid, 15)["type"] == "status"
    assert enrolled_paths(k).count(str(ws.resolve())) == 1


def enrollment_waits(k: Kernel) -> bool:
    return "enrollment of new glob matches waits for a hung filesystem" in k.cli("status").stdout


def test_a_glob_whose_directory_hangs_at_start_holds_neither_ready_nor_an_enrolled_workspace(
    tmp_path: Path,
) -> None:
    """Issue 13: the `workspaces` glob's directory hangs at start (the test-only hang point `glob`): the kernel
    must still reach `ready` within seconds, answer the enrolled B again and again, say in `syscall-kernel status`
    that enrollment waits, and enroll and serve the new match A once the glob returns. On the old kernel the glob
    was expanded on the store worker before the admission: no `ready`, nobody served, while it hung."""
    k, root, b, hang = glob_kernel(tmp_path)
    a = git_workspace(root / "a")
    hang.write_text(f"glob {root}/*")
    t0 = time.monotonic()
    k.start(env=hang_env(hang), wait_ready=False)
    try:
        k.wait_log("event=ready", 20)
        assert time.monotonic() - t0 < 15
        log = k.log_text()
        assert "event=hang_injected step=glob" in log
        assert log.index("event=glob_overdue") < log.index("event=ready")
        assert_served_meanwhile(b)
        wait_for(lambda: enrollment_waits(k), 15, "the waiting enrollment in syscall-kernel status")
        assert not (a / ".syscall").exists(), "A enrolled while its glob hung"
        assert k.log_text().count("event=glob_overdue") == 1, "logged once"

        hang.unlink()
        k.wait_log("event=glob_returned", 15)
        assert_served_when_enrolled(k, a, "a1")
        wait_for(lambda: not enrollment_waits(k), 15, "the status line cleared")
        assert_served_meanwhile(b)
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def test_the_kernel_stops_while_a_glob_hangs_at_start(tmp_path: Path) -> None:
    """SIGTERM before `ready`, while the glob's expansion has not returned (a long deadline: the start is still
    waiting for it): exit 0 promptly, nothing enrolled; the next start enrolls and serves A."""
    k, root, b, hang = glob_kernel(tmp_path, config='backend = "none"\nchannel_io_deadline_seconds = 120\n')
    a = git_workspace(root / "a")
    hang.write_text(f"glob {root}/*")
    k.start(env=hang_env(hang), wait_ready=False)
    try:
        k.wait_log("event=hang_injected step=glob", 20)
        assert_stops_within(k, 3)
        assert "event=ready" not in k.log_text()
        hang.unlink()
        k.start()
        assert_served_when_enrolled(k, a, "a1")
        put_request(b, "b1", status("b1"))
        assert wait_answer(b, "b1")["type"] == "status"
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


@pytest.mark.parametrize("how", ["rescan", "sighup"])
def test_a_glob_that_hangs_in_the_running_kernel_holds_no_enrolled_workspace(
    tmp_path: Path, how: str
) -> None:
    """Issue 13: the running kernel expands its globs at every rescan and on SIGHUP. The glob's directory hangs
    there: B must still be answered, again and again (and the reload finish), and the new match A is enrolled and
    served once the glob returns. On the old kernel the rescan and the reload expanded the globs on the store
    worker, which the loop awaited: nobody was answered while the glob hung."""
    more = tmp_path / "more"
    more.mkdir()
    k, root, b, hang = glob_kernel(tmp_path)
    k.start(env=hang_env(hang))
    try:
        put_request(b, "before", status("before"))
        wait_answer(b, "before")
        assert k.proc is not None
        if how == "rescan":
            hang.write_text(f"glob {root}/*")
            a = git_workspace(root / "a")
        else:
            hang.write_text(f"glob {more}/*")
            a = git_workspace(more / "a")
            k.config.write_text(k.config.read_text().replace(f'"{root}/*"', f'"{root}/*", "{more}/*"'))
            k.proc.send_signal(signal.SIGHUP)
            k.wait_log("event=reloaded", 10)
        k.wait_log("event=hang_injected step=glob", 15)
        assert_served_meanwhile(b)
        k.wait_log("event=glob_overdue", 15)
        assert not (a / ".syscall").exists(), "A enrolled while its glob hung"

        hang.unlink()
        assert_served_when_enrolled(k, a, "a1")
        assert_served_meanwhile(b)
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def test_a_new_match_that_hangs_in_its_preparation_holds_no_other_new_match(tmp_path: Path) -> None:
    """Issue 13: three new glob matches at start; A's channel hangs while it is made (the test-only hang point
    `prepare`). `ready` comes, C and D are enrolled and served (and B answered) while A hangs; A is enrolled,
    exactly once, and served once its filesystem answers. On the old kernel the preparations were recorded in
    glob order as they came back, so A (the first) held every later one, and `ready`."""
    k, root, b, hang = glob_kernel(tmp_path)
    a, c, d = (git_workspace(root / name) for name in ("a", "c", "d"))
    hang.write_text(f"prepare {a.resolve()}")
    k.start(env=hang_env(hang), wait_ready=False)
    try:
        k.wait_log("event=ready", 20)
        k.wait_log("event=enroll_overdue", 15)
        assert_served_when_enrolled(k, c, "c1")
        assert_served_when_enrolled(k, d, "d1")
        assert_served_meanwhile(b)
        assert str(a.resolve()) not in enrolled_paths(k)
        assert k.log_text().count("event=enroll_overdue") == 1, "logged once"

        hang.unlink()
        k.wait_log("event=enroll_io_returned", 15)
        assert_served_when_enrolled(k, a, "a1")
        assert sorted(enrolled_paths(k)) == sorted(str(ws.resolve()) for ws in (a, c, d))
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def test_a_channel_whose_re_watch_hangs_holds_no_other_workspace(tmp_path: Path) -> None:
    """Issue 13: A is served unwatched (its requests/ was replaced when the lost watch was retried, then put
    back: the rescan watches it again), and A's channel hangs when it is opened to watch it again (the test-only
    hang point `watch`). B must still be answered, again and again; A's overdue I/O shows in `syscall-kernel
    status`; once it returns A is watched and served. On the old kernel the re-watch ran on the store worker and
    the loop awaited it: nobody was answered while A hung. (A lost watch whose re-watch hangs is the in-process
    scenario in tests/unit/test_serving_driver.py.)"""
    k, (a, b), hang = kernel_with(tmp_path, "a", "b")
    k.start(env=hang_env(hang))
    requests = a / ".syscall" / "requests"
    away = a / ".syscall" / "requests.away"
    try:
        put_request(a, "before", status("before"))
        wait_answer(a, "before")
        os.rename(requests, away)
        requests.mkdir()  # not the directory enrolled: the re-watch fails (ChannelMoved)
        k.wait_log("event=watch_failed", 15)
        hang.write_text(f"watch {a.resolve()}")
        requests.rmdir()
        os.rename(away, requests)
        k.wait_log("event=hang_injected step=watch", 15)

        assert_served_meanwhile(b)
        assert_overdue_shown(k, a)

        hang.unlink()
        k.wait_log("event=channel_io_returned", 15)
        wait_for(lambda: problem_of(k, a) is None, 15, "A's problem cleared")
        put_request(a, "a1", status("a1"))
        assert wait_answer(a, "a1", 5)["type"] == "status"
        assert_served_meanwhile(b)
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def test_new_matches_whose_filesystem_sync_hangs_hold_neither_ready_nor_an_enrolled_workspace(
    tmp_path: Path,
) -> None:
    """Issue 13: before new matches' rows commit, their filesystem is synced (a committed row means durable channel
    files). That sync hangs (the test-only hang point `sync`, named by the batch's first path on it): `ready` comes,
    B is answered, nothing is recorded while the sync has not returned, and both new matches are enrolled and
    served once it returns. On the old kernel the sync ran on the store worker, inside the start."""
    k, root, b, hang = glob_kernel(tmp_path)
    a, c = (git_workspace(root / name) for name in ("a", "c"))
    hang.write_text(f"sync {a.resolve()}")
    k.start(env=hang_env(hang), wait_ready=False)
    try:
        k.wait_log("event=ready", 20)
        k.wait_log("event=enroll_sync_overdue", 15)
        assert_served_meanwhile(b)
        assert enrolled_paths(k) == [], "a row committed before its channel files were synced"
        wait_for(lambda: enrollment_waits(k), 15, "the waiting enrollment in syscall-kernel status")

        hang.unlink()
        k.wait_log("event=enroll_sync_returned", 15)
        assert_served_when_enrolled(k, a, "a1")
        assert_served_when_enrolled(k, c, "c1")
        wait_for(lambda: not enrollment_waits(k), 15, "the status line cleared")
    finally:
        hang.unlink(missing_ok=True)
        k.stop()


def kernel_fds_under(k: Kernel, prefix: str) -> list[str]:
    """The kernel process's open fds whose target starts with `prefix`."""
    assert k.proc is not None
    fds = Path(f"/proc/{k.proc.pid}/fd")
    found = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith(prefix):
            found.append(target)
    return found


def test_letting_go_of_a_hung_channels_lock_holds_no_other_workspace(tmp_path: Path) -> None:
    """Issue 13: the operator unenrolls A; the kernel lets A's channel lock go by closing its fd, which on a network
    filesystem is the server's unlock and blocks while the server is hung (the test-only hang point `unlock`). B
    must still be answered, again and again; A's fd is closed once the close returns. On the old kernel the close
    ran in a store step (the poll tick's `_apply_rows`): nobody was answered while it hung."""
    k, (a, b), hang = kernel_with(tmp_path, "a", "b")
    k.start(env=hang_env(hang))
    try:
        put_request(a, "before", status("before"))
        wait_answer(a, "before")
        hang.write_text(f"unlock {workspace_key(str(a.resolve()))}")
        k.cli("unenroll", str(a))  # the channel goes (moved aside, removed); the kernel still holds its fd
        k.wait_log("event=hang_injected step=unlock", 15)
        assert kernel_fds_under(k, f"{a.resolve()}/.syscall"), "A's lock was let go while its close hung"

        assert_served_meanwhile(b)

        hang.unlink()
        wait_for(lambda: not kernel_fds_under(k, f"{a.resolve()}/.syscall"), 15, "A's lock fd closed")
        assert_served_meanwhile(b)
    finally:
        hang.unlink(missing_ok=True)
        k.stop()
