"""`channel.safefs` against a hostile agent, on REAL directories.

pyfakefs emulates dir_fd and O_NOFOLLOW by joining strings, so it cannot show any of this; every test here plants
the attack in a tmp_path and checks both that the kernel refuses and that nothing outside the channel was read
or modified.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channel.limits import REQUEST_MAX_BYTES
from channel.paths import CHANNEL_DIR, ChannelPaths
from channel.safefs import (
    KERNEL_TEMP_PREFIX,
    Channel,
    ChannelMoved,
    Identity,
    Refused,
    SubdirReplaced,
    copy_atomic_at,
    open_channel,
    open_dir,
    read_capped_at,
    read_capped_fd,
    sweep_kernel_temps,
    write_atomic_at,
)
from spec.conformance.checks import written_in_place
from spec.conformance.inotify import IN_MOVED_TO, Watcher

CAP = REQUEST_MAX_BYTES


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM interrupts a blocking syscall in the main thread."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_fd_leak() -> Iterator[None]:
    before = open_fds()
    yield
    leaked = open_fds() - before
    assert not leaked, f"file descriptors leaked: {sorted(leaked)}"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the workspace that the agent would like the kernel to read or write."""
    d = tmp_path / "outside"
    d.mkdir()
    return d


def chan(ws: Path) -> Path:
    return ws / CHANNEL_DIR


def requests_dir(ws: Path) -> Path:
    return chan(ws) / ChannelPaths.REQUESTS


def refusal(excinfo: pytest.ExceptionInfo[Refused]) -> str:
    return excinfo.value.reason


# --- enrollment and identity -------------------------------------------------------------------------------


def test_enrollment_creates_the_channel_and_its_subdirectories(ws: Path) -> None:
    with open_channel(ws, create=True) as channel:
        assert Identity.of_fd(channel.fd).same_directory(channel.identity)
        st_chan = os.stat(chan(ws))
        subdirs = tuple(
            (sub, os.stat(chan(ws) / sub).st_dev, os.stat(chan(ws) / sub).st_ino)
            for sub in ChannelPaths.SUBDIRS
        )
        # The channel and, recorded with it, each subdirectory as enrollment made it (spec 2.3).
        assert channel.identity == Identity(st_chan.st_dev, st_chan.st_ino, st_chan.st_uid, subdirs)
    for sub in ChannelPaths.SUBDIRS:
        assert stat.S_ISDIR(os.lstat(chan(ws) / sub).st_mode)
    # Re-opening with the recorded identity works; enrolling twice is harmless.
    with open_channel(ws, channel.identity) as again, open_channel(ws, channel.identity, create=True):
        again.check()


def test_a_channel_that_is_a_symlink_is_never_followed(ws: Path, outside: Path) -> None:
    chan(ws).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ChannelMoved, match="symlink"):
        open_channel(ws)
    with pytest.raises(ChannelMoved):
        open_channel(ws, create=True)
    assert list(outside.iterdir()) == [], "enrollment created something through the symlink"


def test_enrollment_refuses_a_planted_symlink_subdirectory(ws: Path, outside: Path) -> None:
    chan(ws).mkdir()
    (chan(ws) / ChannelPaths.ANSWERS).symlink_to(outside, target_is_directory=True)
    with pytest.raises(Refused) as e:
        open_channel(ws, create=True)
    assert refusal(e) == "not a directory"
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("swap", ["other-directory", "symlink-to-the-enrolled-directory", "gone", "file"])
def test_a_channel_swapped_after_enrollment_is_detected(ws: Path, swap: str) -> None:
    with open_channel(ws, create=True) as channel:
        enrolled = channel.identity
        chan(ws).rename(ws / "moved")
        if swap == "other-directory":
            chan(ws).mkdir()
        elif swap == "symlink-to-the-enrolled-directory":
            # Same dev and inode behind the link: only O_NOFOLLOW tells them apart.
            chan(ws).symlink_to(ws / "moved", target_is_directory=True)
        elif swap == "file":
            chan(ws).write_bytes(b"")
        with pytest.raises(ChannelMoved):
            channel.check()
        with pytest.raises(ChannelMoved):
            open_channel(ws, enrolled)


def test_a_removed_workspace_is_channel_moved(tmp_path: Path) -> None:
    ws = tmp_path / "gone"
    ws.mkdir()
    with open_channel(ws, create=True) as channel:
        for sub in ChannelPaths.SUBDIRS:
            (chan(ws) / sub).rmdir()
        chan(ws).rmdir()
        ws.rmdir()
        with pytest.raises(ChannelMoved, match="cannot be opened"):
            channel.check()


def test_a_channel_owned_by_someone_else_is_refused(ws: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    with open_channel(ws, create=True) as channel:
        enrolled = channel.identity
    os.chown(chan(ws), enrolled.uid + 4242, -1)
    with pytest.raises(ChannelMoved, match="uid"):
        open_channel(ws)
    with pytest.raises(ChannelMoved):
        open_channel(ws, enrolled)


def test_a_subdirectory_owned_by_someone_else_is_refused(ch: Channel, ws: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    os.chown(chan(ws) / ChannelPaths.WAKES, ch.identity.uid + 4242, -1)
    with pytest.raises(Refused, match="owned by uid"):
        ch.write_file(ChannelPaths.WAKES, "s.json", b"{}")
    assert os.listdir(chan(ws) / ChannelPaths.WAKES) == []


@pytest.mark.parametrize("swap", ["other-directory", "symlink-to-it", "fifo", "gone", "other-owner"])
def test_check_subdirs_refuses_a_subdirectory_that_is_not_the_one_recorded(
    ch: Channel, ws: Path, outside: Path, swap: str
) -> None:
    """The per-turn check (one fstatat each) judges as an open of the subdirectory would: a new directory under
    the name is SubdirReplaced; a symlink (even to the recorded directory), a FIFO, nothing, or another owner
    is refused, and nothing is followed."""
    ch.check_subdirs()
    answers = chan(ws) / ChannelPaths.ANSWERS
    if swap == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("changing a directory's owner needs root")
        os.chown(answers, ch.identity.uid + 4242, -1)
        with pytest.raises(Refused, match="owned by uid"):
            ch.check_subdirs()
        return
    answers.rename(outside / "answers")
    if swap == "other-directory":
        answers.mkdir()
        with pytest.raises(SubdirReplaced, match="was replaced since enrollment"):
            ch.check_subdirs()
        return
    if swap == "symlink-to-it":
        answers.symlink_to(outside / "answers", target_is_directory=True)
    elif swap == "fifo":
        os.mkfifo(answers)
    with pytest.raises(Refused) as e, deadline(5):
        ch.check_subdirs()
    assert refusal(e) == ("missing" if swap == "gone" else "not a directory")


def test_open_dir_needs_an_absolute_path_and_does_not_follow_a_final_symlink(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute"):
        open_dir("relative/dir")
    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(OSError, match=r"Not a directory|Too many levels of symbolic links"):
        open_dir(tmp_path / "link")


def test_a_closed_channel_refuses_use(ws: Path) -> None:
    channel = open_channel(ws, create=True)
    channel.close()
    channel.close()
    with pytest.raises(ValueError, match="closed"):
        channel.list_requests()


# --- reading requests ---------------------------------------------------------------------------------------


def test_a_committed_request_is_read(ch: Channel, ws: Path) -> None:
    body = b'{"protocol": 1, "id": "abc", "type": "status"}'
    (requests_dir(ws) / "abc.json").write_bytes(body)
    assert ch.read_request("abc") == body


def test_a_request_of_exactly_the_cap_is_read_and_one_byte_more_is_refused(ch: Channel, ws: Path) -> None:
    (requests_dir(ws) / "full.json").write_bytes(b"x" * CAP)
    assert len(ch.read_request("full")) == CAP
    (requests_dir(ws) / "over.json").write_bytes(b"x" * (CAP + 1))
    with pytest.raises(Refused) as e:
        ch.read_request("over")
    assert refusal(e) == f"larger than {CAP} bytes"


def test_a_fifo_planted_as_a_request_is_refused_without_blocking(ch: Channel, ws: Path) -> None:
    os.mkfifo(requests_dir(ws) / "fifo.json")
    with deadline(3), pytest.raises(Refused) as e:
        ch.read_request("fifo")
    assert refusal(e) == "not a regular file"


def test_a_fifo_that_slipped_past_the_prescreen_is_decided_by_fstat_without_blocking(tmp_path: Path) -> None:
    # The race where a regular file is swapped for a FIFO between the pre-screen and the open: what was
    # opened is judged, and a FIFO with a live writer (so a read would block forever) is never read.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        with deadline(3), pytest.raises(Refused) as e:
            read_capped_fd(reader, CAP)
        assert refusal(e) == "not a regular file"
    finally:
        os.close(writer)
        os.close(reader)


def test_a_symlinked_request_is_never_followed(ch: Channel, ws: Path, outside: Path) -> None:
    secret = outside / "secret.json"
    secret.write_bytes(b'{"id": "abc", "token": "SECRET"}')
    before = secret.stat()
    (requests_dir(ws) / "abc.json").symlink_to(secret)
    with pytest.raises(Refused) as e:
        ch.read_request("abc")
    assert refusal(e) == "a symlink"
    assert "SECRET" not in str(e.value)
    assert secret.read_bytes() == b'{"id": "abc", "token": "SECRET"}'
    assert secret.stat().st_mtime_ns == before.st_mtime_ns


def test_a_symlinked_requests_directory_is_never_followed(ch: Channel, ws: Path, outside: Path) -> None:
    (outside / "abc.json").write_bytes(b"{}")
    requests_dir(ws).rmdir()
    requests_dir(ws).symlink_to(outside, target_is_directory=True)
    with pytest.raises(Refused, match="not a directory"):
        ch.list_requests()
    with pytest.raises(Refused, match="not a directory"):
        ch.read_request("abc")
    with pytest.raises(Refused, match="not a directory"):
        ch.remove_request("abc.json")
    assert os.listdir(outside) == ["abc.json"]


def test_a_hardlinked_request_is_refused(ch: Channel, ws: Path, outside: Path) -> None:
    victim = outside / "state.json"
    victim.write_bytes(b'{"kernel": "private"}')
    os.link(victim, requests_dir(ws) / "abc.json")
    with pytest.raises(Refused) as e:
        ch.read_request("abc")
    assert refusal(e) == "hardlinked (st_nlink=2)"


def test_a_directory_planted_as_a_request_is_refused(ch: Channel, ws: Path) -> None:
    (requests_dir(ws) / "abc.json").mkdir()
    with pytest.raises(Refused) as e:
        ch.read_request("abc")
    assert refusal(e) == "not a regular file"


def test_a_request_that_vanished_is_refused(ch: Channel) -> None:
    with pytest.raises(Refused) as e:
        ch.read_request("never-written")
    assert refusal(e) == "vanished"


def test_a_sparse_gigabyte_is_refused_after_reading_at_most_cap_plus_one_bytes(ch: Channel, ws: Path) -> None:
    big = requests_dir(ws) / "big.json"
    with big.open("wb") as f:
        f.truncate(1 << 30)
    started = time.monotonic()
    with pytest.raises(Refused) as e:
        ch.read_request("big")
    assert refusal(e) == f"larger than {CAP} bytes"
    fd = os.open(big, os.O_RDONLY)
    try:
        with pytest.raises(Refused):
            read_capped_fd(fd, CAP)
        assert os.lseek(fd, 0, os.SEEK_CUR) == CAP + 1
    finally:
        os.close(fd)
    assert time.monotonic() - started < 2, "reading looks like it went through the whole gigabyte"


def test_a_request_that_keeps_growing_is_refused_without_chasing_it(ch: Channel, ws: Path) -> None:
    path = requests_dir(ws) / "grow.json"
    path.write_bytes(b"")
    stop = threading.Event()

    def append_forever() -> None:
        with path.open("ab", buffering=0) as f:
            while not stop.is_set():
                f.write(b"x" * 4096)

    writer = threading.Thread(target=append_forever)
    writer.start()
    fd = os.open(path, os.O_RDONLY)
    try:
        limit = time.monotonic() + 5
        while path.stat().st_size <= CAP:
            assert time.monotonic() < limit, "the writer thread did not grow the file"
        with pytest.raises(Refused):
            ch.read_request("grow")
        with pytest.raises(Refused) as e:
            read_capped_fd(fd, CAP)
        assert refusal(e) in (f"larger than {CAP} bytes", "changed while being read")
        assert os.lseek(fd, 0, os.SEEK_CUR) <= CAP + 1
        assert writer.is_alive(), "the read only returned once the file stopped growing"
    finally:
        stop.set()
        writer.join()
        os.close(fd)


def test_st_size_is_never_trusted(tmp_path: Path) -> None:
    # procfs files are regular, singly linked and report st_size 0 whatever they hold: a lying st_size.
    fd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        assert os.fstat(fd).st_size == 0
        with pytest.raises(Refused, match="larger than 100 bytes"):
            read_capped_fd(fd, 100)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 101
    finally:
        os.close(fd)


def test_reading_starts_at_the_beginning_whatever_the_fd_offset(tmp_path: Path) -> None:
    f = tmp_path / "r.json"
    f.write_bytes(b'{"a": 1}')
    fd = os.open(f, os.O_RDONLY)
    try:
        os.lseek(fd, 0, os.SEEK_END)
        assert read_capped_fd(fd, CAP) == b'{"a": 1}'
    finally:
        os.close(fd)


def test_invalid_request_ids_are_value_errors_not_paths(ch: Channel) -> None:
    for bad in ("../x", "a/b", "", "UPPER", "..", "x.json"):
        with pytest.raises(ValueError, match="not a valid request id"):
            ch.read_request(bad)


# --- listing and removing -----------------------------------------------------------------------------------


def test_list_requests_separates_committed_temp_and_junk(ch: Channel, ws: Path) -> None:
    rq = os.fsencode(requests_dir(ws))
    committed = [b"a.json", b"b-1.json", b"1764460800000-3fa9c2d1.json"]
    temps = [b".c.tmp", b".1764460800000-3fa9c2d1.tmp"]
    junk_names = [
        b"Bad.json",  # uppercase is not an id
        b"-a.json",  # an id starts with a letter or digit
        b"x.txt",  # wrong suffix
        b"a.json.bak",
        b".json",  # empty stem
        b"\xff\xfe.json",  # odd bytes
        b"\xc3\xa9.json",  # non-ASCII
        b"x\n.json",  # newline
        b"\x1b[31m.json",  # terminal escape
        b"a" * 65 + b".json",  # id too long
    ]
    for name in committed + temps + junk_names:
        with open(os.path.join(rq, name), "wb"):
            pass
    os.mkdir(os.path.join(rq, b"emptydir"))
    ids, junk = ch.list_requests()
    assert ids == ["1764460800000-3fa9c2d1", "a", "b-1"]
    assert sorted(os.fsencode(n) for n in junk) == sorted([*junk_names, b"emptydir"])

    for junk_name in junk:
        ch.remove_request(junk_name)
    assert sorted(os.listdir(rq)) == sorted(committed + temps)
    assert ch.list_requests() == (["1764460800000-3fa9c2d1", "a", "b-1"], [])


def test_refusals_never_echo_odd_bytes_raw(ch: Channel, ws: Path) -> None:
    rq = os.fsencode(requests_dir(ws))
    name = b"\x1b]0;pwned\x07\xff"
    os.mkfifo(os.path.join(rq, name))
    dfd = os.open(rq, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(Refused) as e:
            read_capped_at(dfd, os.fsdecode(name), CAP)
    finally:
        os.close(dfd)
    assert str(e.value).isascii()
    assert "\x1b" not in str(e.value)
    assert "\x07" not in str(e.value)


def test_remove_request_is_fine_with_a_missing_file_and_refuses_a_full_directory(
    ch: Channel, ws: Path
) -> None:
    ch.remove_request("not-there.json")
    full = requests_dir(ws) / "full"
    full.mkdir()
    (full / "inside").write_bytes(b"keep")
    with pytest.raises(Refused) as e:
        ch.remove_request("full")
    assert refusal(e) == "a non-empty directory"
    assert (full / "inside").read_bytes() == b"keep"


def test_remove_request_removes_a_symlink_not_its_target(ch: Channel, ws: Path, outside: Path) -> None:
    target = outside / "keep.json"
    target.write_bytes(b"keep")
    (requests_dir(ws) / "x.json").symlink_to(target)
    ch.remove_request("x.json")
    assert not os.path.lexists(requests_dir(ws) / "x.json")
    assert target.read_bytes() == b"keep"


# --- writing ------------------------------------------------------------------------------------------------


def kernel_temps_in(d: Path) -> list[str]:
    return [n for n in os.listdir(d) if n.startswith(KERNEL_TEMP_PREFIX)]


def test_write_file_is_atomic_with_the_requested_mode(ch: Channel, ws: Path) -> None:
    ch.write_file(ChannelPaths.ANSWERS, "abc.json", b'{"v": 1}', mode=0o640)
    ch.write_file(ChannelPaths.ANSWERS, "abc.json", b'{"v": 2}', mode=0o640)
    ch.write_file(None, ChannelPaths.KERNEL_JSON, b"{}")
    answer = chan(ws) / ChannelPaths.ANSWERS / "abc.json"
    assert answer.read_bytes() == b'{"v": 2}'
    assert stat.S_IMODE(answer.stat().st_mode) == 0o640
    assert (chan(ws) / ChannelPaths.KERNEL_JSON).read_bytes() == b"{}"
    assert stat.S_IMODE((chan(ws) / ChannelPaths.KERNEL_JSON).stat().st_mode) == 0o644
    assert kernel_temps_in(chan(ws) / ChannelPaths.ANSWERS) == []
    assert kernel_temps_in(chan(ws)) == []


@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_an_atomic_write_over_a_planted_link_replaces_the_name_and_spares_the_target(
    ch: Channel, ws: Path, outside: Path, plant: str
) -> None:
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    for where in (chan(ws) / ChannelPaths.ANSWERS / "abc.json", chan(ws) / ChannelPaths.BUDGET_JSON):
        if plant == "symlink":
            where.symlink_to(victim)
        else:
            os.link(victim, where)
    ch.write_file(ChannelPaths.ANSWERS, "abc.json", b"answer")
    ch.write_file(None, ChannelPaths.BUDGET_JSON, b"budget")
    for where, data in (
        (chan(ws) / ChannelPaths.ANSWERS / "abc.json", b"answer"),
        (chan(ws) / ChannelPaths.BUDGET_JSON, b"budget"),
    ):
        st_where = os.lstat(where)
        assert stat.S_ISREG(st_where.st_mode)
        assert st_where.st_nlink == 1
        assert where.read_bytes() == data
    assert victim.read_bytes() == b"precious"
    assert victim.stat().st_nlink == 1


@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_a_link_planted_at_the_temp_name_is_neither_followed_nor_reused(
    ch: Channel, ws: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, plant: str
) -> None:
    # Temp names are random, so an agent can only win this by guessing; force the guess right to show that even
    # then the temp is created fresh (O_EXCL) and the next random name is used.
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    answers = chan(ws) / ChannelPaths.ANSWERS
    guessed = answers / f"{KERNEL_TEMP_PREFIX}{'a' * 16}.tmp"
    if plant == "symlink":
        guessed.symlink_to(victim)
    else:
        os.link(victim, guessed)
    names = iter(["a" * 16, "b" * 16])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
    ch.write_file(ChannelPaths.ANSWERS, "abc.json", b"answer")
    assert (answers / "abc.json").read_bytes() == b"answer"
    assert victim.read_bytes() == b"precious"
    assert os.path.lexists(guessed), "the agent's file was not ours to remove"


def test_writing_into_a_symlinked_subdirectory_is_refused(ch: Channel, ws: Path, outside: Path) -> None:
    wakes = chan(ws) / ChannelPaths.WAKES
    wakes.rmdir()
    wakes.symlink_to(outside, target_is_directory=True)
    with pytest.raises(Refused) as e:
        ch.write_file(ChannelPaths.WAKES, "s.md", b"wake")
    assert refusal(e) == "not a directory"
    assert os.listdir(outside) == []


def test_a_failed_write_leaves_no_temp_file_and_the_old_content(ch: Channel, ws: Path) -> None:
    answers = chan(ws) / ChannelPaths.ANSWERS
    (answers / "blocked.json").mkdir()
    (answers / "blocked.json" / "x").write_bytes(b"")
    with pytest.raises(Refused) as e:
        ch.write_file(ChannelPaths.ANSWERS, "blocked.json", b"{}")
    assert refusal(e) == "a directory is in the way"
    assert kernel_temps_in(answers) == []
    assert os.listdir(answers / "blocked.json") == ["x"]


def test_sweep_removes_only_the_kernels_own_leftover_temps(ch: Channel, ws: Path) -> None:
    answers = chan(ws) / ChannelPaths.ANSWERS
    leftover = f"{KERNEL_TEMP_PREFIX}{'0' * 16}.tmp"
    (answers / leftover).write_bytes(b"half")
    (answers / ".agent.tmp").write_bytes(b"")
    (answers / "a.json").write_bytes(b"{}")
    dfd = ch.subdir(ChannelPaths.ANSWERS)
    try:
        assert sweep_kernel_temps(dfd) == 1
    finally:
        os.close(dfd)
    assert sorted(os.listdir(answers)) == [".agent.tmp", "a.json"]


def test_a_sweep_after_ready_leaves_the_temps_of_writes_in_progress(ch: Channel, ws: Path) -> None:
    """The restart's sweep runs after `ready`, beside writes of this process: only temps older than it go."""
    answers = chan(ws) / ChannelPaths.ANSWERS
    old, young = (f"{KERNEL_TEMP_PREFIX}{c * 16}.tmp" for c in "01")
    (answers / old).write_bytes(b"left by a killed kernel")
    started = time.time_ns()
    os.utime(answers / old, ns=(started - 10**9, started - 10**9))
    (answers / young).write_bytes(b"being written now")
    dfd = ch.subdir(ChannelPaths.ANSWERS)
    try:
        assert sweep_kernel_temps(dfd, before_ns=started) == 1
    finally:
        os.close(dfd)
    assert os.listdir(answers) == [young]


# --- delivery -----------------------------------------------------------------------------------------------


def test_delivery_dir_creates_the_tree_under_results(ch: Channel, ws: Path) -> None:
    components = ChannelPaths.result_dir(3, "train", 1)
    dfd = ch.delivery_dir(components)
    try:
        write_atomic_at(dfd, "curve.json", b"[1, 2]")
    finally:
        os.close(dfd)
    assert (chan(ws) / ChannelPaths.RESULTS / "3" / "train" / "1" / "curve.json").read_bytes() == b"[1, 2]"
    os.close(ch.delivery_dir(components))  # opening an existing tree again is fine


@pytest.mark.parametrize("shown_first", [False, True])
def test_an_atomic_write_is_durable_when_it_returns_and_shown_first_renames_before_the_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shown_first: bool
) -> None:
    """The order of the steps, recorded: with `shown_first` the name is in place before either fsync (a reader
    sees it a disk flush sooner), and both fsyncs (the file, then its directory) still come before the return,
    so a caller that removes a request after the call removes it only once its answer is durable."""
    d = tmp_path / "answers"
    d.mkdir()
    steps: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        steps.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def rename(*args: object, **kw: object) -> None:
        steps.append("rename")
        real_rename(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_atomic_at(dfd, "a.json", b"answer", shown_first=shown_first)
    finally:
        os.close(dfd)
    want = ["rename", "fsync file", "fsync dir"] if shown_first else ["fsync file", "rename", "fsync dir"]
    assert steps == want
    assert (d / "a.json").read_bytes() == b"answer"
    assert os.listdir(d) == ["a.json"], "the temp file was left behind"


@pytest.mark.parametrize("shown_first", [False, True])
def test_an_atomic_write_is_never_written_or_closed_after_writing_under_its_final_name(
    tmp_path: Path, shown_first: bool
) -> None:
    """Seen by inotify (as the conformance suite's 2.4 check sees it): under the final name only the rename, no
    IN_MODIFY and no IN_CLOSE_WRITE (a client that takes IN_CLOSE_WRITE for a finished file must not see one)."""
    d = tmp_path / "answers"
    d.mkdir()
    with Watcher([str(d)]) as w:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            write_atomic_at(dfd, "a.json", b"answer", shown_first=shown_first)
        finally:
            os.close(dfd)
        time.sleep(0.2)
        events = w.events()
    assert not written_in_place(events, str(d), "a.json"), events
    assert [e for e in events if e.name == "a.json" and e.mask & IN_MOVED_TO], "no rename into place seen"


def test_shown_first_is_refused_by_a_directory_in_the_way_and_leaves_nothing(tmp_path: Path) -> None:
    d = tmp_path / "answers"
    (d / "a.json").mkdir(parents=True)
    (d / "a.json" / "inside").write_text("kept")
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(Refused):
            write_atomic_at(dfd, "a.json", b"answer", shown_first=True)
    finally:
        os.close(dfd)
    assert os.listdir(d) == ["a.json"]
    assert (d / "a.json" / "inside").read_text() == "kept"


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_delivery_through_a_planted_symlink_is_refused(
    ch: Channel, ws: Path, outside: Path, depth: int
) -> None:
    components = ("3", "train", "0")
    results = chan(ws) / ChannelPaths.RESULTS
    parent = results.joinpath(*components[:depth])
    parent.mkdir(parents=True, exist_ok=True)
    (parent / components[depth]).symlink_to(outside, target_is_directory=True)
    with pytest.raises(Refused) as e:
        ch.delivery_dir(components)
    assert refusal(e) == "not a directory"
    assert e.value.name == "/".join((ChannelPaths.RESULTS, *components[: depth + 1]))
    assert os.listdir(outside) == [], "something was created through the symlink"


def test_delivery_with_results_itself_a_symlink_is_refused(ch: Channel, ws: Path, outside: Path) -> None:
    results = chan(ws) / ChannelPaths.RESULTS
    results.rmdir()
    results.symlink_to(outside, target_is_directory=True)
    with pytest.raises(Refused, match="not a directory"):
        ch.delivery_dir(("1", "a"))
    assert os.listdir(outside) == []


def test_delivery_with_a_file_planted_at_a_level_is_refused(ch: Channel, ws: Path) -> None:
    (chan(ws) / ChannelPaths.RESULTS / "1").write_bytes(b"")
    with pytest.raises(Refused, match="not a directory"):
        ch.delivery_dir(("1", "a"))


# --- copy ---------------------------------------------------------------------------------------------------


def test_copy_streams_the_source_and_reports_size_and_sha256(tmp_path: Path, outside: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)
    src = tmp_path / "artifact"
    src.write_bytes(data)
    dst = tmp_path / "dst"
    dst.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    (dst / "out.bin").symlink_to(victim)
    dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    sfd = os.open(src, os.O_RDONLY)
    try:
        os.lseek(sfd, 1000, os.SEEK_SET)  # the copy starts at the beginning whatever the offset
        size, digest = copy_atomic_at(dfd, "out.bin", sfd, limit=len(data))
    finally:
        os.close(sfd)
        os.close(dfd)
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    assert (dst / "out.bin").read_bytes() == data
    assert not os.path.islink(dst / "out.bin")
    assert victim.read_bytes() == b"precious"


def test_copy_above_the_limit_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "artifact"
    src.write_bytes(b"y" * 5000)
    dst = tmp_path / "dst"
    dst.mkdir()
    dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    sfd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(Refused) as e:
            copy_atomic_at(dfd, "out.bin", sfd, limit=4999)
        assert refusal(e) == "larger than 4999 bytes"
        assert copy_atomic_at(dfd, "out.bin", sfd, limit=5000)[0] == 5000
    finally:
        os.close(sfd)
        os.close(dfd)
    assert os.listdir(dst) == ["out.bin"]


def test_copy_counts_the_bytes_streamed_not_st_size(tmp_path: Path) -> None:
    # A procfs file says st_size 0 and holds more: the streamed count decides, and nothing is left behind.
    dst = tmp_path / "dst"
    dst.mkdir()
    dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    sfd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        assert os.fstat(sfd).st_size == 0
        with pytest.raises(Refused, match="larger than 100 bytes"):
            copy_atomic_at(dfd, "status", sfd, limit=100)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert os.listdir(dst) == []


def test_copy_of_a_source_grown_past_the_limit_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "artifact"
    src.write_bytes(b"z" * 100)
    dst = tmp_path / "dst"
    dst.mkdir()
    dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    sfd = os.open(src, os.O_RDONLY)
    try:
        size, _ = copy_atomic_at(dfd, "ok", sfd, limit=100)
        assert size == 100
        with src.open("ab") as f:
            f.write(b"z" * 100)
        with pytest.raises(Refused, match="larger than 150 bytes"):
            copy_atomic_at(dfd, "grown", sfd, limit=150)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert sorted(os.listdir(dst)) == ["ok"]


def test_copy_failing_midstream_removes_its_temp(tmp_path: Path) -> None:
    src = tmp_path / "artifact"
    src.write_bytes(b"data")
    dst = tmp_path / "dst"
    dst.mkdir()
    dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    sfd = os.open(src, os.O_WRONLY)  # a regular file, but reading it fails (EBADF) after the temp exists
    try:
        with pytest.raises(OSError, match="Bad file descriptor"):
            copy_atomic_at(dfd, "out", sfd, limit=100)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert os.listdir(dst) == []


def test_copy_refuses_a_fifo_source(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    sfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with deadline(3), pytest.raises(Refused, match="source is not a regular file"):
            copy_atomic_at(dfd, "out", sfd, limit=100)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert sorted(os.listdir(tmp_path)) == ["fifo"]


# --- races: the agent is live while the kernel works --------------------------------------------------------


@contextlib.contextmanager
def agent_loop(step: Callable[[int], None]) -> Iterator[None]:
    """Run `step(i)` for i = 0, 1, ... in another thread until the block ends (the agent acting concurrently)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        i = 0
        try:
            while not stop.is_set():
                step(i)
                i += 1
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
    assert not errors, f"the agent thread failed: {errors[0]!r}"


def test_reads_racing_a_swapping_agent_never_return_a_foreign_file(
    ch: Channel, ws: Path, outside: Path
) -> None:
    secret = outside / "secret"
    secret.write_bytes(b"SECRET")
    rq = requests_dir(ws)
    name = rq / "abc.json"
    name.write_bytes(b"ok")
    # The agent got one link to the foreign file into its channel and keeps it; it has no access outside.
    held = rq / ".held"
    os.link(secret, held)

    def swap(i: int) -> None:
        tmp = rq / ".swap"
        kind = i % 4
        if kind == 0:
            tmp.symlink_to(secret)
        elif kind == 1:
            os.link(held, tmp)
        elif kind == 2:
            os.mkfifo(tmp)
        else:
            tmp.write_bytes(b"ok")
        os.replace(tmp, name)

    outcomes: set[str] = set()
    with agent_loop(swap), deadline(10):
        for _ in range(1500):
            try:
                data = ch.read_request("abc")
            except Refused as e:
                outcomes.add(e.reason.split(" (")[0])  # st_nlink varies with the interleaving
            else:
                assert data == b"ok"
                outcomes.add("read")
    assert outcomes <= {
        "read",
        "a symlink",
        "hardlinked",
        "not a regular file",
        "vanished",
        "replaced while being read",
        "changed while being read",
    }
    assert secret.read_bytes() == b"SECRET"


def test_a_hardlink_dropped_while_the_kernel_reads_is_not_read(ch: Channel, ws: Path, outside: Path) -> None:
    # The agent's last link to a foreign file sits at the request name; it swaps a plain file over it while the
    # kernel reads, so the foreign file is singly linked again by the time the kernel fstats it. The kernel must
    # notice that the name no longer leads to what it opened. (Each trial hands the agent a fresh link, never
    # while a read is in flight: an agent that can keep relinking a foreign name could read that file itself.)
    secret = outside / "secret"
    secret.write_bytes(b"SECRET")
    rq = requests_dir(ws)
    name = rq / "abc.json"
    start = threading.Barrier(2, timeout=5)
    done = threading.Barrier(2, timeout=5)
    trials = 200

    def agent() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            for _ in range(trials):
                (rq / ".plain").write_bytes(b"ok")
                start.wait()
                os.replace(rq / ".plain", name)
                done.wait()

    t = threading.Thread(target=agent)
    t.start()
    outcomes: set[str] = set()
    try:
        for _ in range(trials):
            with contextlib.suppress(FileNotFoundError):
                name.unlink()
            os.link(secret, name)
            start.wait()
            with deadline(5):
                while True:  # read until a read sees the swap: that read is the one racing it
                    try:
                        data = ch.read_request("abc")
                    except Refused as e:
                        if e.reason == "hardlinked (st_nlink=2)":
                            continue
                        outcomes.add(e.reason)
                    else:
                        assert data == b"ok", "the kernel read the foreign file"
                        outcomes.add("read")
                    break
            done.wait()
    finally:
        start.abort()
        done.abort()
        t.join()
    assert outcomes <= {"read", "replaced while being read", "changed while being read", "vanished"}


def test_writes_racing_a_link_planting_agent_never_touch_the_victim(
    ch: Channel, ws: Path, outside: Path
) -> None:
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    answers = chan(ws) / ChannelPaths.ANSWERS

    def plant(i: int) -> None:
        tmp = answers / ".plant"
        if i % 2:
            tmp.symlink_to(victim)
        else:
            os.link(victim, tmp)
        os.replace(tmp, answers / "abc.json")

    with agent_loop(plant):
        for i in range(300):
            ch.write_file(ChannelPaths.ANSWERS, "abc.json", b"answer %d" % i)
    assert victim.read_bytes() == b"precious"
    assert kernel_temps_in(answers) == []


def test_the_requests_directory_swapped_for_a_symlink_mid_stream_is_never_followed(
    ch: Channel, ws: Path, outside: Path
) -> None:
    (outside / "abc.json").write_bytes(b"SECRET")
    rq = requests_dir(ws)
    (rq / "abc.json").write_bytes(b"ok")
    aside = chan(ws) / "requests.aside"

    def swap(i: int) -> None:
        if i % 2 == 0:
            os.rename(rq, aside)
            rq.symlink_to(outside, target_is_directory=True)
        else:
            rq.unlink()
            os.rename(aside, rq)

    outcomes: set[str] = set()
    with agent_loop(swap):
        for _ in range(1500):
            try:
                data = ch.read_request("abc")
            except Refused as e:
                outcomes.add(e.reason)
            else:
                assert data == b"ok"
                outcomes.add("read")
    assert outcomes <= {"read", "not a directory", "missing"}
    assert (outside / "abc.json").read_bytes() == b"SECRET"


# --- names --------------------------------------------------------------------------------------------------

BAD_NAMES = ["", ".", "..", "a/b", "../x", "/etc/passwd", "x/", "a\0b", "n" * 256, "\ud800"]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=ascii)
def test_names_that_are_not_single_components_are_value_errors(
    ch: Channel, ws: Path, tmp_path: Path, bad: str
) -> None:
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    dfd = ch.subdir(ChannelPaths.ANSWERS)
    sfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        calls: list[Callable[[], object]] = [
            lambda: write_atomic_at(dfd, bad, b"x"),
            lambda: read_capped_at(dfd, bad, CAP),
            lambda: copy_atomic_at(dfd, bad, sfd, 10),
            lambda: ch.subdir(bad),
            lambda: ch.remove_request(bad),
            lambda: ch.write_file(bad, "ok.json", b"x"),
            lambda: ch.write_file(ChannelPaths.ANSWERS, bad, b"x"),
            lambda: ch.delivery_dir(("1", bad)),
            lambda: ch.delivery_dir((bad, "1")),
        ]
        for call in calls:
            with pytest.raises(ValueError, match=r"file name|single path component"):
                call()
    finally:
        os.close(sfd)
        os.close(dfd)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_delivery_dir_needs_a_component(ch: Channel) -> None:
    with pytest.raises(ValueError, match="at least one component"):
        ch.delivery_dir(())


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=0, max_size=260))
def test_any_name_is_refused_or_stays_one_entry_in_its_directory(name: str) -> None:
    with tempfile.TemporaryDirectory() as top:
        inner = os.path.join(top, "d")
        os.mkdir(inner)
        dfd = os.open(inner, os.O_RDONLY | os.O_DIRECTORY)
        try:
            write_atomic_at(dfd, name, b"payload")
        except ValueError:
            assert os.listdir(inner) == []
        else:
            assert os.listdir(inner) == [name]
            assert read_capped_at(dfd, name, 100) == b"payload"
        finally:
            os.close(dfd)
        assert os.listdir(top) == ["d"], "a write escaped its directory"


_byte_names = st.binary(min_size=1, max_size=80).filter(lambda b: b"/" not in b and b"\0" not in b)


@settings(max_examples=60, deadline=None)
@given(st.sets(_byte_names, max_size=12).map(lambda s: s - {b".", b".."}))
def test_list_requests_puts_every_name_in_exactly_one_class(names: set[bytes]) -> None:
    with tempfile.TemporaryDirectory() as top, open_channel(top, create=True) as channel:
        rq = os.path.join(os.fsencode(top), os.fsencode(CHANNEL_DIR), b"requests")
        for n in names:
            with open(os.path.join(rq, n), "wb"):
                pass
        ids, junk = channel.list_requests()
        committed = {os.fsencode(ChannelPaths.request(i)) for i in ids}
        junk_b = {os.fsencode(j) for j in junk}
        temps = {n for n in names if n.startswith(b".") and n.endswith(b".tmp")}
        assert committed | junk_b | temps == names
        assert len(committed) + len(junk_b) + len(temps) == len(names), "a name fell in two classes"
        assert ids == sorted(ids)
        for request_id in ids:
            assert request_id.isascii()
            assert channel.read_request(request_id) == b""


def test_removing_an_answered_request_keeps_a_new_one_renamed_over_its_name(ch: Channel, ws: Path) -> None:
    # The kernel answers, then removes the request; a client that reused the id in between (a replay, or
    # `request.id.reused`) renamed a new file over the name: removing it unread would lose it, never answered.
    req = ws / CHANNEL_DIR / ChannelPaths.REQUESTS
    (req / "r1.json").write_bytes(b'{"first": 1}')
    data, inode = ch.read_request_entry("r1")
    assert data == b'{"first": 1}'
    (req / ".r1.tmp").write_bytes(b'{"second": 2}')
    os.rename(req / ".r1.tmp", req / "r1.json")
    ch.remove_request("r1.json", only=inode)
    assert (req / "r1.json").read_bytes() == b'{"second": 2}'
    _, inode = ch.read_request_entry("r1")
    ch.remove_request("r1.json", only=inode)
    assert not (req / "r1.json").exists()
    ch.remove_request("r1.json", only=inode)  # already gone is fine


def test_a_request_renamed_over_the_name_between_check_and_removal_is_kept(
    ch: Channel, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race the conformance suite hit under load: the kernel's check sees the answered request, then the
    # client renames its next commit over the name, then the removal runs. The new request must survive.
    req = ws / CHANNEL_DIR / ChannelPaths.REQUESTS
    (req / "r1.json").write_bytes(b'{"first": 1}')
    _, inode = ch.read_request_entry("r1")
    real_stat = os.stat
    raced = []

    def stat_then_client_commits(path: object, *args: object, **kwargs: object) -> os.stat_result:
        got = real_stat(path, *args, **kwargs)  # type: ignore[arg-type]
        if path == "r1.json" and not raced:
            raced.append(True)
            (req / ".r1.tmp").write_bytes(b'{"second": 2}')
            os.rename(req / ".r1.tmp", req / "r1.json")
        return got

    monkeypatch.setattr(os, "stat", stat_then_client_commits)
    ch.remove_request("r1.json", only=inode)
    monkeypatch.undo()
    assert raced
    assert (req / "r1.json").read_bytes() == b'{"second": 2}'
    assert sorted(os.listdir(req)) == ["r1.json"]  # nothing left aside
    st = os.stat(req / "r1.json")
    assert st.st_nlink == 1
