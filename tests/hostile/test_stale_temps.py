"""`Channel.remove_stale_temps` on REAL directories: only temps older than the cutoff go, links are never followed.

Ages are set with `os.utime` (on the link itself for symlinks), so nothing waits for a clock to move.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from channel.paths import CHANNEL_DIR, ChannelPaths
from channel.safefs import Channel, Refused, TempSweep

HOUR_NS = 3600 * 10**9


def req(ws: Path) -> Path:
    return ws / CHANNEL_DIR / ChannelPaths.REQUESTS


def age(path: Path, seconds: float) -> None:
    """Set the entry's own mtime (a symlink's, not its target's) `seconds` into the past."""
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def cutoff_ago(seconds: float) -> int:
    return time.time_ns() - int(seconds * 1e9)


def test_only_temps_older_than_the_cutoff_are_removed(ch: Channel, ws: Path) -> None:
    rq = req(ws)
    for name, seconds in ((".old.tmp", 660), (".edge.tmp", 540), (".new.tmp", 0), (".future.tmp", -3600)):
        (rq / name).write_bytes(b"{}")
        age(rq / name, seconds)
    (rq / "a.json").write_bytes(b"{}")
    age(rq / "a.json", 86400)

    listing = ch.scan_requests()
    assert listing.ids == ["a"]
    assert listing.junk == []
    assert sorted(listing.temps) == [".edge.tmp", ".future.tmp", ".new.tmp", ".old.tmp"]
    assert ch.list_requests() == (["a"], [])  # unchanged: temps are neither

    assert ch.remove_stale_temps(listing.temps, cutoff_ago(600)) == TempSweep(removed=1, young=3, kept=0)
    assert sorted(os.listdir(rq)) == [".edge.tmp", ".future.tmp", ".new.tmp", "a.json"]
    # Exactly at the cutoff counts as old: the grace is "older than or equal to N".
    mtime = os.stat(rq / ".edge.tmp").st_mtime_ns
    assert ch.remove_stale_temps([".edge.tmp"], mtime) == TempSweep(removed=1, young=0, kept=0)
    assert ch.remove_stale_temps([".new.tmp"], mtime) == TempSweep(removed=0, young=1, kept=0)


def test_a_symlink_is_judged_and_removed_as_a_link_never_followed(
    ch: Channel, ws: Path, tmp_path: Path
) -> None:
    rq = req(ws)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    age(victim, 7200)
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    (victim_dir / ".inner.tmp").write_text("keep me too")
    age(victim_dir / ".inner.tmp", 7200)
    age(victim_dir, 7200)

    # A fresh link to an old target is young: its own mtime counts.
    (rq / ".fresh-link.tmp").symlink_to(victim)
    # An old link is removed as a link; what it points to is untouched.
    (rq / ".old-link.tmp").symlink_to(victim)
    age(rq / ".old-link.tmp", 7200)
    (rq / ".old-dirlink.tmp").symlink_to(victim_dir)
    age(rq / ".old-dirlink.tmp", 7200)
    (rq / ".dangling.tmp").symlink_to(tmp_path / "nowhere")
    age(rq / ".dangling.tmp", 7200)

    swept = ch.remove_stale_temps(ch.scan_requests().temps, cutoff_ago(600))
    assert swept == TempSweep(removed=3, young=1, kept=0)
    assert os.listdir(rq) == [".fresh-link.tmp"]
    assert victim.read_text() == "keep me"
    assert (victim_dir / ".inner.tmp").read_text() == "keep me too"
    assert not (tmp_path / "nowhere").exists()


def test_a_directory_named_like_a_temp_goes_only_if_empty(ch: Channel, ws: Path) -> None:
    rq = req(ws)
    (rq / ".empty.tmp").mkdir()
    full = rq / ".full.tmp"
    full.mkdir()
    (full / "data").write_text("agent's")
    (rq / ".young-dir.tmp").mkdir()
    os.mkfifo(rq / ".fifo.tmp")
    for name in (".empty.tmp", ".full.tmp", ".fifo.tmp"):
        age(rq / name, 3600)

    swept = ch.remove_stale_temps(ch.scan_requests().temps, cutoff_ago(600))
    assert swept == TempSweep(removed=2, young=1, kept=1)
    assert sorted(os.listdir(rq)) == [".full.tmp", ".young-dir.tmp"]
    assert (full / "data").read_text() == "agent's"


def test_vanished_names_are_skipped_and_only_temp_names_are_accepted(ch: Channel, ws: Path) -> None:
    assert ch.remove_stale_temps([".gone.tmp"], time.time_ns()) == TempSweep(removed=0, young=0, kept=0)
    (req(ws) / "a.json").write_bytes(b"{}")
    (req(ws) / ".ok.tmp").write_bytes(b"{}")
    age(req(ws) / ".ok.tmp", 3600)
    for bad in ("a.json", "x.tmp", "../.x.tmp", ".a/.b.tmp", ".tmp/"):
        with pytest.raises(ValueError, match=r"temp name|single"):
            ch.remove_stale_temps([".ok.tmp", bad], time.time_ns() + HOUR_NS)
    # The batch is checked before anything is removed.
    assert sorted(os.listdir(req(ws))) == [".ok.tmp", "a.json"]


def test_a_planted_requests_symlink_is_refused_before_anything_is_removed(
    ch: Channel, ws: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".x.tmp").write_text("not the channel's")
    age(elsewhere / ".x.tmp", 3600)
    rq = req(ws)
    rq.rmdir()
    rq.symlink_to(elsewhere)
    with pytest.raises(Refused, match="not a directory"):
        ch.remove_stale_temps([".x.tmp"], cutoff_ago(600))
    assert (elsewhere / ".x.tmp").read_text() == "not the channel's"
