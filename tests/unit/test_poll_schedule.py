"""The poll schedule (kernel.core.polling) and the poller's batches (kernel.service.polling), with a fake clock
and fake stamps: which polled channels are listed, when, and what a hung `stat` holds."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from kernel.core.polling import IDLE_GRID, RACY_NS, DirStamp, PollSchedule, RescanLedger
from kernel.service.polling import Poller, stamp_of

OLD_NS = 1_000 * 10**9  # a directory last changed long before the looks below
NOW_NS = 2_000 * 10**9


def st(mtime_ns: int = OLD_NS, ino: int = 1, size: int = 4096) -> DirStamp:
    return DirStamp(1, ino, mtime_ns, mtime_ns, size, 2)


def sched(base: float = 0.5, idle: float = 4.0) -> PollSchedule:
    return PollSchedule(base, idle)


def test_a_new_channel_is_listed_then_skipped_while_its_stamp_holds() -> None:
    s = sched()
    s.sync({"a"}, 0.0)
    assert s.due(0.0, 10) == ["a"]
    assert s.looked("a", st(), NOW_NS, 0.0) is True  # nothing trusted yet: list it
    s.listed("a", 0.0)
    assert s.due(0.4, 10) == []
    assert s.due(0.5, 10) == ["a"]
    assert s.looked("a", st(), NOW_NS, 0.5) is False  # unchanged since the listing
    assert s.next_at() == pytest.approx(1.5)  # the interval doubled


def test_an_idle_channel_backs_off_to_the_idle_interval_and_activity_brings_it_back() -> None:
    s = sched(0.5, 4.0)
    s.sync({"a"}, 0.0)
    s.due(0.0, 1)
    s.looked("a", st(), NOW_NS, 0.0)
    s.listed("a", 0.0)
    now, gaps = 0.0, []
    for _ in range(6):
        nxt = s.next_at()
        assert nxt is not None
        gaps.append(round(nxt - now, 3))
        now = nxt
        assert s.due(now, 1) == ["a"]
        assert s.looked("a", st(), NOW_NS, now) is False
    assert gaps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    s.active("a", now)  # the kernel answered it
    assert s.next_at() == pytest.approx(now + 0.5)


def test_idle_looks_fall_on_a_grid_and_never_later_than_the_idle_interval() -> None:
    s = sched(0.5, 4.0)
    keys = [f"k{i}" for i in range(40)]
    for i, key in enumerate(keys):  # polled from 0.01 s apart, then idle
        now = i * 0.01
        s.sync(set(keys[: i + 1]), now)
        assert s.due(now, 100) == [key]
        s.looked(key, st(), NOW_NS, now)
        s.listed(key, now)
    looks: dict[str, list[float]] = {k: [i * 0.01] for i, k in enumerate(keys)}
    now = 0.0
    while now < 40.0:
        nxt = s.next_at()
        assert nxt is not None
        now = nxt
        for key in s.due(now, 100):
            s.looked(key, st(), NOW_NS, now)
            looks[key].append(now)
    grid = 4.0 / IDLE_GRID
    for times in looks.values():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert max(gaps) <= 4.0 + 1e-9  # never later than the idle interval
        assert all(abs(t / grid - round(t / grid)) < 1e-6 for t in times[-3:])  # idle: on the grid
    assert len({t for times in looks.values() for t in times[-3:]}) <= 3 * 2  # due together


def test_a_changed_stamp_is_listed_and_trusted_only_after_a_listing_that_began_after_the_look() -> None:
    s = sched()
    s.sync({"a"}, 0.0)
    s.due(0.0, 1)
    s.looked("a", st(), NOW_NS, 0.0)
    s.listed("a", 0.0)
    changed = st(ino=1, size=8192, mtime_ns=OLD_NS + 5)
    s.due(0.5, 1)
    assert s.looked("a", changed, NOW_NS, 0.5) is True
    # a listing planned before that look completes: it may have missed what the stamp shows
    s.listed("a", 0.4)
    s.due(1.0, 1)
    assert s.looked("a", changed, NOW_NS, 1.0) is True
    s.listed("a", 1.1)  # this one began after the look
    s.due(1.5, 1)
    assert s.looked("a", changed, NOW_NS, 1.5) is False


def test_a_listing_slower_than_the_looks_still_trusts_the_stamp_it_began_after() -> None:
    """Looks every base_s see the same changed stamp while its listing waits for a slot: the listing began after
    the first of them, which is enough (else a loaded kernel would list every channel at every look)."""
    s = sched()
    s.sync({"a"}, 0.0)
    s.due(0.0, 1)
    s.looked("a", st(), NOW_NS, 0.0)
    s.listed("a", 0.0)
    changed = st(size=8192, mtime_ns=OLD_NS + 5)
    for now in (0.5, 1.0, 1.5):
        s.due(now, 1)
        assert s.looked("a", changed, NOW_NS, now) is True
    s.listed("a", 0.6)  # planned after the look at 0.5, done after the one at 1.5
    s.due(2.0, 1)
    assert s.looked("a", changed, NOW_NS, 2.0) is False


def test_a_look_not_followed_by_a_listing_lists_again() -> None:
    """The turn was deferred or failed (no `listed`): the same stamp is not taken as listed."""
    s = sched()
    s.sync({"a"}, 0.0)
    s.due(0.0, 1)
    assert s.looked("a", st(), NOW_NS, 0.0) is True
    s.due(0.5, 1)
    assert s.looked("a", st(), NOW_NS, 0.5) is True


def test_a_racy_stamp_is_listed_at_every_look_until_it_is_old_enough() -> None:
    """Changed within RACY_NS of the look: a rename in the same timestamp tick would leave it equal."""
    s = sched()
    recent = st(mtime_ns=NOW_NS - RACY_NS // 2)
    s.sync({"a"}, 0.0)
    s.due(0.0, 1)
    s.looked("a", recent, NOW_NS, 0.0)
    s.listed("a", 0.0)
    s.due(0.5, 1)
    assert s.looked("a", recent, NOW_NS, 0.5) is True  # equal, but racy
    s.listed("a", 0.6)
    s.due(1.0, 1)
    assert s.looked("a", recent, NOW_NS + RACY_NS, 1.0) is False  # equal and old now


def test_a_replaced_directory_or_a_failed_stat_is_listed() -> None:
    s = sched()
    s.sync({"a"}, 0.0)
    s.due(0.0, 1)
    s.looked("a", st(), NOW_NS, 0.0)
    s.listed("a", 0.0)
    s.due(0.5, 1)
    assert s.looked("a", st(ino=2), NOW_NS, 0.5) is True
    s.listed("a", 0.6)
    s.due(1.0, 1)
    assert s.looked("a", None, NOW_NS, 1.0) is True


def test_a_look_in_flight_is_never_asked_for_twice() -> None:
    s = sched()
    s.sync({"a", "b"}, 0.0)
    assert sorted(s.due(0.0, 10)) == ["a", "b"]
    s.active("a", 0.1)  # an answer while its look is in flight
    assert s.due(100.0, 10) == []
    s.listed("a", 0.0)
    assert s.looked("a", st(), NOW_NS, 0.2) is True
    s.skipped("b", 0.2)
    assert sorted(s.due(0.7, 10)) == ["a", "b"]


def test_sync_follows_the_polled_set_and_due_respects_the_limit() -> None:
    s = sched()
    s.sync({f"k{i}" for i in range(10)}, 0.0)
    assert len(s.due(0.0, 4)) == 4
    s.sync({"k0", "new"}, 1.0)
    assert s.keys() == {"k0", "new"}
    assert "new" in s.due(1.0, 10)


def test_the_idle_interval_below_the_fast_one_is_refused() -> None:
    with pytest.raises(ValueError, match="below base_s"):
        PollSchedule(5.0, 1.0)


def test_stamp_of_a_real_channel_changes_with_a_rename_in_and_not_with_a_read(tmp_path: Path) -> None:
    req = tmp_path / ".syscall" / "requests"
    req.mkdir(parents=True)
    before = stamp_of(str(tmp_path))
    assert before is not None
    os.listdir(req)
    assert stamp_of(str(tmp_path)) == before
    time.sleep(0.01)  # past a coarse timestamp tick
    (req / ".r1.tmp").write_text("{}")
    os.rename(req / ".r1.tmp", req / "r1.json")
    assert stamp_of(str(tmp_path)) != before
    assert stamp_of(str(tmp_path / "missing")) is None


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_poller_marks_changed_channels_and_gives_up_a_hung_stat_alone() -> None:
    """A batch stuck on one channel's `stat` past the deadline hands the rest of its keys back; they are looked
    at by a new batch while the stuck one waits, and the stuck channel is marked (its turn shows the hang)."""
    release = threading.Event()
    stamps = {"/a": st(), "/b": st(), "/c": st(ino=3)}

    def fake_stamp(path: str) -> DirStamp | None:
        if path == "/b":
            release.wait(10)
        return stamps[path]

    async def main() -> tuple[list[str], list[str]]:
        clock = _Clock()
        s = PollSchedule(0.5, 4.0)
        changed: list[str] = []
        poller = Poller(s, clock, lambda: 1.0, changed.append, stamp=fake_stamp)
        token = anyio.lowlevel.current_token()
        paths = {"a": "/a", "b": "/b", "c": "/c"}
        s.sync(set(paths), 0.0)
        poller.tick(token, paths.get)  # one batch, in key order: a, b (hangs), c
        await anyio.sleep(0.2)
        first = list(changed)
        poller.tick(token, paths.get)
        assert not poller.stuck()  # not past the deadline yet
        clock.t = 2.0  # past the deadline
        poller.tick(token, paths.get)  # cut the stuck batch at "b": "a" applied, "c" handed back
        clock.t = 2.5
        poller.tick(token, paths.get)  # "c" looked at by a new batch
        await anyio.sleep(0.2)
        second = list(changed)
        release.set()
        await anyio.sleep(0.2)
        assert not poller.stuck()
        return first, second

    first, second = anyio.run(main)
    assert first == []  # the batch is stuck on "b": nothing delivered yet
    assert second[:2] == ["a", "b"]  # "a" applied and "b" marked at the cut
    assert "c" in second[2:]  # by the next batch (with "a" again: no listing followed its look)


def test_the_pollers_threads_are_kept_and_bounded() -> None:
    """Batches run on threads the poller keeps (a thread started per batch made the loop wait for each start):
    batches one after another share one thread, and a stuck batch's thread is not reused while it hangs."""
    release = threading.Event()
    ran_on: list[int] = []

    def fake_stamp(path: str) -> DirStamp | None:
        ran_on.append(threading.get_native_id())
        if path == "/hang":
            release.wait(10)
        return st()

    async def main() -> tuple[set[int], set[int]]:
        clock = _Clock()
        s = PollSchedule(0.5, 4.0)
        poller = Poller(s, clock, lambda: 1.0, lambda key: None, stamp=fake_stamp)
        token = anyio.lowlevel.current_token()
        paths = {"a": "/a"}
        s.sync(set(paths), 0.0)
        for _ in range(20):
            n = len(ran_on)
            poller.tick(token, paths.get)
            with anyio.fail_after(5):
                while poller.running() or len(ran_on) == n:  # until this batch is back on the loop
                    await anyio.lowlevel.checkpoint()
            clock.t += 1.0  # "a" is due again
        sequential = set(ran_on)
        ran_on.clear()
        paths = {"g": "/hang", "z": "/z"}
        s.sync(set(paths), clock.t)
        poller.tick(token, paths.get)  # one batch, in key order: "g" hangs, "z" waits behind it
        await anyio.sleep(0.1)
        clock.t += 2.0  # past the deadline: the stuck batch is cut at "g", "z" handed back
        poller.tick(token, paths.get)
        clock.t += 0.5
        poller.tick(token, paths.get)  # "z" looked at by a new batch, on a new thread
        await anyio.sleep(0.1)
        release.set()
        await anyio.sleep(0.1)
        return sequential, set(ran_on)

    sequential, with_stuck = anyio.run(main)
    assert len(sequential) == 1, sequential  # one thread ran all 20 batches
    assert len(with_stuck) == 2, with_stuck  # the stuck thread's place was taken by a second one


def test_a_channel_served_again_is_not_looked_at_by_its_old_entries() -> None:
    """A channel forgotten and served again gets a new entry; the old one's heap entries stay stale (its
    generation count restarted at 0 made one of them live again: a look at the old time)."""
    s = PollSchedule(0.5, 4.0)
    s.sync({"a"}, 0.0)
    s.sync(set(), 1.0)
    s.sync({"a"}, 5.0)
    assert s.next_at() == 5.0
    assert s.due(4.9, 10) == []
    assert s.due(5.0, 10) == ["a"]
    ledger = RescanLedger()
    ledger.sync({"a"}, 0.0)
    ledger.sync(set(), 1.0)
    ledger.sync({"a"}, 5.0)
    assert ledger.next_at() == 5.0
