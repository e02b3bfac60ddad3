"""When to look at a polled channel, and whether a look must list it: pure (times and stamps in, keys out).

A channel on a filesystem that raises no events (NFS, Lustre, GPFS: a write on another host is not seen by
inotify here) is polled. Listing it in full costs a dozen system calls (open and check the channel and each
subdirectory, read `requests/`); at 10,000 channels every half second that is several cores. Instead, each
look is one `stat` of `requests/` (its `DirStamp`), and only a changed stamp leads to a full listing.

Invariants, and why they hold:
- A stamp is trusted (an unchanged stamp means "nothing to list") only once a full listing that began after the
  first look that saw that stamp has completed (`listed`): a stamp seen but not yet followed by a listing (the turn
  was deferred, failed, or the kernel stopped) is listed at the next look.
- A stamp is never trusted while it is *racy*: when the directory was changed within `racy_s` of the clock at
  the look (a file renamed in after our listing but within the same timestamp tick leaves the stamp equal:
  coarse kernel clocks tick every few ms, some filesystems keep whole seconds). Such a channel is listed at
  every look until its last change is older than `racy_s` (git's "racy clean" rule).
- The rescan is the ground truth even for a server whose clock runs behind ours (where a racy change can look
  old to the rule above), without listing every channel: `RescanLedger`, below.
- A channel with activity (a changed stamp, or an answer the kernel just gave it: the agent often replies at
  once) is looked at every `base_s`; each look that finds nothing doubles its interval up to `idle_max_s`.
  So an active channel's pickup is at most `base_s` (p50 about `base_s / 2`), and an idle one costs a `stat`
  every `idle_max_s`.
- An idle channel's next look (at `idle_max_s`) is moved back to the grid of `idle_max_s / IDLE_GRID` seconds,
  never later: the idle channels' looks fall due together, a few times a second, in full batches (at 10,000
  channels the loop wakes and a thread starts for each batch: 50 a second without the grid, 16 with it), and an
  idle channel is still looked at within `idle_max_s`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

# Idle looks fall on a grid of idle_max_s / IDLE_GRID seconds.
IDLE_GRID: Final = 8
# A directory changed within this long of the look (wall clock, ns) may change again within the same timestamp
# tick unseen: 2 s covers filesystems that keep whole seconds.
RACY_NS: Final = 2_000_000_000


class DirStamp(NamedTuple):
    """What a `stat` of a directory says about its entries: a new entry, a rename or a removal changes its
    mtime and ctime (and, on most filesystems, its size or link count); a replaced directory has a new inode.
    (A tuple: 2,500 are made and compared a second at 10,000 idle polled channels.)"""

    dev: int
    ino: int
    mtime_ns: int
    ctime_ns: int
    size: int
    nlink: int

    def changed_within(self, wall_ns: int, racy_ns: int) -> bool:
        return max(self.mtime_ns, self.ctime_ns) > wall_ns - racy_ns


class _Entry(Protocol):
    generation: int  # set anew at every reschedule; heap entries of another generation are stale
    looking: bool


# A schedule's heap: (due, generation, key), only the entry of a key's current generation live. Generations come
# from one counter per schedule (`_generations`), never from the channel's entry: a channel forgotten and served
# again gets a new entry, and its old heap entries must stay stale (with a count restarted at 0, one of them
# became live again: a look at the old entry's time).
_Heap = list[tuple[float, int, str]]


def _earliest(heap: _Heap, channels: Mapping[str, _Entry]) -> float | None:
    """When the earliest live entry is due (stale ones are dropped on the way)."""
    while heap:
        due, gen, key = heap[0]
        ch = channels.get(key)
        if ch is not None and ch.generation == gen:
            return due
        heapq.heappop(heap)  # stale: rescheduled or forgotten since
    return None


def _take_due(heap: _Heap, channels: Mapping[str, _Entry], now: float, limit: int) -> list[str]:
    """Up to `limit` keys due by `now`, earliest first, each taken off (`looking`) until it is pushed again."""
    out: list[str] = []
    while heap and len(out) < limit:
        due, gen, key = heap[0]
        ch = channels.get(key)
        if ch is None or ch.generation != gen:
            heapq.heappop(heap)
            continue
        if due > now:
            break
        heapq.heappop(heap)
        ch.generation = 0  # off the schedule (no entry has generation 0) until it is pushed again
        ch.looking = True
        out.append(key)
    return out


@dataclass(slots=True)
class _Channel:
    interval: float
    due: float
    trusted: DirStamp | None = None  # the stamp a completed full listing followed
    seen: DirStamp | None = None  # the stamp of the last look, until a listing follows it
    seen_at: float = 0.0  # when that look was taken (the service's clock)
    generation: int = 0  # set anew at every reschedule; heap entries of another generation are stale
    looking: bool = False  # taken by `due`, not yet put back by `looked` or `skipped`
    boosted: bool = False  # `active` while its look was in flight: the next interval is the fast one


@dataclass(slots=True)
class PollSchedule:
    """The polled channels' next looks. `due(now)` gives the keys to look at; `looked` says which of them to
    list in full; `listed` marks a listing done; `active` brings a channel back to the fast interval."""

    base_s: float
    idle_max_s: float
    racy_ns: int = RACY_NS
    _channels: dict[str, _Channel] = field(default_factory=dict)
    _heap: _Heap = field(default_factory=list)
    _generations: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        if self.idle_max_s < self.base_s:
            raise ValueError(f"idle_max_s ({self.idle_max_s}) is below base_s ({self.base_s})")

    def __len__(self) -> int:
        return len(self._channels)

    def __contains__(self, key: object) -> bool:
        return key in self._channels

    def keys(self) -> set[str]:
        return set(self._channels)

    def sync(self, polled: set[str], now: float) -> None:
        """Follow the set of polled channels: new ones are looked at now, gone ones forgotten. (Called at every
        change of the polled set: the same set costs one comparison of the sets, not a walk of 10,000 keys.)"""
        if self._channels.keys() == polled:
            return
        for key in [k for k in self._channels if k not in polled]:
            del self._channels[key]
        for key in sorted(polled - self._channels.keys()):  # in key order: looks of equal times are too
            ch = _Channel(self.base_s, now)
            self._channels[key] = ch
            self._push(key, ch)

    def forget(self, key: str) -> None:
        """`key` is no longer polled (unenrolled): its entry goes now (its heap entries are stale)."""
        self._channels.pop(key, None)

    def _push(self, key: str, ch: _Channel) -> None:
        ch.generation = next(self._generations)
        heapq.heappush(self._heap, (ch.due, ch.generation, key))

    def next_at(self) -> float | None:
        """When the earliest look is due (None: nothing is polled)."""
        return _earliest(self._heap, self._channels)

    def due(self, now: float, limit: int) -> list[str]:
        """Up to `limit` keys whose look is due, earliest first. Each is taken off the schedule until `looked`
        (or `skipped`) puts it back, so a look in flight is never asked for twice."""
        return _take_due(self._heap, self._channels, now, limit)

    def looked(self, key: str, stamp: DirStamp | None, wall_ns: int, now: float) -> bool:
        """A look at `key` found `stamp` (None: the stat failed, which a listing explains to the operator) at
        wall-clock `wall_ns`. True when the channel must be listed in full; its next look is scheduled."""
        ch = self._channels.get(key)
        if ch is None:
            return False
        unchanged = (
            stamp is not None and stamp == ch.trusted and not stamp.changed_within(wall_ns, self.racy_ns)
        )
        ch.looking = False
        if unchanged and ch.boosted:
            ch.interval = self.base_s
        elif unchanged:
            ch.interval = min(ch.interval * 2, self.idle_max_s)
        else:
            ch.interval = self.base_s
            if stamp is None or stamp == ch.trusted:
                ch.seen = None  # racy, not changed: listed again, nothing new to trust afterwards
            elif stamp != ch.seen:
                # Kept from the first look that saw it: a listing begun after that one trusts it, though looks
                # every `base_s` see it again while the listing waits (else a kernel whose listings take longer
                # than `base_s` would never trust a stamp, and list every channel at every look).
                ch.seen, ch.seen_at = stamp, now
        ch.boosted = False
        ch.due = now + ch.interval
        if ch.interval >= self.idle_max_s > self.base_s:
            grid = self.idle_max_s / IDLE_GRID
            ch.due = max(now + self.base_s, math.floor(ch.due / grid) * grid)
        self._push(key, ch)
        return not unchanged

    def skipped(self, key: str, now: float) -> None:
        """A due look that did not happen (its channel hung, or the kernel is stopping): due again at `now`
        plus the fast interval."""
        ch = self._channels.get(key)
        if ch is not None and ch.looking:
            ch.looking = False
            ch.due = now + self.base_s
            self._push(key, ch)

    def listed(self, key: str, started: float) -> None:
        """A full listing of `key`, begun at `started` (the service's clock), completed: the stamp its last look
        saw is trusted from now on if that look came before the listing began (a listing begun earlier may have
        missed what the stamp already shows)."""
        ch = self._channels.get(key)
        if ch is not None and ch.seen is not None and started >= ch.seen_at:
            ch.trusted, ch.seen = ch.seen, None

    def active(self, key: str, now: float) -> None:
        """The kernel just answered `key` or woke it: the agent is likely to write again soon."""
        ch = self._channels.get(key)
        if ch is None:
            return
        if ch.looking:
            ch.boosted = True
        elif ch.interval > self.base_s or ch.due > now + self.base_s:
            ch.interval = self.base_s
            ch.due = min(ch.due, now + self.base_s)
            self._push(key, ch)


# What the rescan stats of a served channel: its `requests/` and its kernel.json (dev, ino, size, mtime_ns,
# ctime_ns; kernel.io.enroll.Fingerprint). None where a stat failed.
Evidence = tuple[DirStamp | None, tuple[int, int, int, int, int] | None]


@dataclass(slots=True)
class _Checked:
    due: float
    trusted: Evidence | None = None  # what a confirming check (below) found unchanged
    seen: Evidence | None = None  # the evidence of the last look, until a check confirms it
    first_at: float = 0.0  # when `seen` was first looked at (the service's clock)
    fresh: bool = True  # never looked at since it was served (its admission and first listing just ran)
    generation: int = 0
    queued: bool = False  # a live entry of it is on the heap
    looking: bool = False


@dataclass(slots=True)
class RescanLedger:
    """Which served channels (watched or polled) the rescan must check in full: list `requests/` and read the
    owner its kernel.json names (a turn of the pipeline with the owner check). Every `rescan_seconds` each
    channel's evidence (`Evidence`: two `lstat`s) is looked at; only a channel whose evidence is not `trusted`
    is checked. Pure: times in, keys out.

    Invariants, and why they hold:
    - Evidence is trusted only once a check (a full listing and an owner read) that began at least `racy_s`
      after that very evidence was first looked at has completed (`checked`). This needs no clock of the
      server's: the change that gave the evidence its timestamps came before our first look at it, and a later
      change that leaves the timestamps equal (same tick, or a server clock behind ours) comes within one tick of
      it (ticks are at most `racy_s`; ctimes never move back), so before that check began: the check saw it.
      After that, any change moves a ctime forward, and nobody can set a ctime back: unequal evidence.
    - So an unchanged trusted channel costs two `lstat`s per rescan and no listing; any other is checked at the
      rescan that sees it (a request hidden from the poll's stamp by a clock behind ours is answered then), and
      again `racy_s` after its evidence was first seen (`next_at`), which confirms it.
    - Evidence that differs from the trusted one drops the trust (a channel swapped away and back, or whose check
      failed meanwhile, is checked again); evidence with a failed stat (None in it) is never trusted.
    - A channel new to the ledger (just served: its admission read its owner, its first listing is under way)
      is not checked at its first look, only `racy_s` later, to confirm.
    - A look in flight is never asked for twice (`due` takes it off until `looked` or `skipped`).
    """

    racy_s: float = RACY_NS / 1e9
    _channels: dict[str, _Checked] = field(default_factory=dict)
    _heap: _Heap = field(default_factory=list)
    _generations: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def __len__(self) -> int:
        return len(self._channels)

    def keys(self) -> set[str]:
        return set(self._channels)

    def sync(self, served: set[str], now: float) -> None:
        """Follow the set of served channels: new ones are looked at from `now` on, gone ones forgotten."""
        for key in [k for k in self._channels if k not in served]:
            del self._channels[key]
        for key in sorted(served - self._channels.keys()):  # in key order, as PollSchedule.sync
            ch = self._channels[key] = _Checked(now)
            self._push(key, ch)

    def trusted(self, key: str) -> bool:
        """Whether `key`'s evidence is trusted (a rescan that finds it unchanged checks nothing)."""
        ch = self._channels.get(key)
        return ch is not None and ch.trusted is not None

    def rescan(self, now: float) -> None:
        """The rescan: every channel not looked at right now is due now."""
        for key, ch in self._channels.items():
            if not ch.looking and not (ch.queued and ch.due <= now):
                ch.due = now
                self._push(key, ch)

    def _push(self, key: str, ch: _Checked) -> None:
        ch.generation = next(self._generations)
        ch.queued = True
        heapq.heappush(self._heap, (ch.due, ch.generation, key))

    def next_at(self) -> float | None:
        """When the earliest look is due (None: none is, until the next rescan)."""
        return _earliest(self._heap, self._channels)

    def due(self, now: float, limit: int) -> list[str]:
        """Up to `limit` keys whose look is due, earliest first, each taken off until `looked` or `skipped`."""
        out = _take_due(self._heap, self._channels, now, limit)
        for key in out:
            self._channels[key].queued = False
        return out

    def looked(self, key: str, evidence: Evidence, wall_ns: int, now: float) -> bool:
        """A look at `key` found `evidence` (`wall_ns` is unused: the rule needs no wall clock). True when the
        channel must be checked in full now."""
        ch = self._channels.get(key)
        if ch is None:
            return False
        ch.looking = False
        fresh, ch.fresh = ch.fresh, False
        if evidence == ch.trusted:
            return False
        ch.trusted = None
        if None in evidence:
            ch.seen = None
            return True  # a failed stat: the check says why (and it is checked at every rescan)
        if evidence != ch.seen:
            ch.seen, ch.first_at = evidence, now
            ch.due = now + self.racy_s  # looked at again then, to confirm it
            self._push(key, ch)
            return not fresh
        if now >= ch.first_at + self.racy_s:
            return True  # the confirming check (`checked`)
        ch.due = ch.first_at + self.racy_s
        self._push(key, ch)
        return False

    def skipped(self, key: str, now: float) -> None:
        """A due look that did not happen (its channel hung, or the kernel is stopping): due again in `racy_s`."""
        ch = self._channels.get(key)
        if ch is not None and ch.looking:
            ch.looking = False
            ch.due = now + self.racy_s
            self._push(key, ch)

    def checked(self, key: str, started: float) -> None:
        """A full listing of `key` with its owner read, begun at `started` (the service's clock), completed: the
        evidence last looked at is trusted if it was first looked at `racy_s` or more before that."""
        ch = self._channels.get(key)
        if ch is not None and ch.seen is not None and started >= ch.first_at + self.racy_s:
            ch.trusted, ch.seen = ch.seen, None
