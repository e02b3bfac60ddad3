"""A small second kernel, for testing the conformance runner: correct by default, one MUST broken by --flaw.

    python tests/conformance/fake_kernel.py WORKSPACE --flaw NAME

It lays out the channel (kernel.json, budget.json, the directories), then polls `requests/` every few
milliseconds: decodes with the reference decoder, answers, replays by id and bytes, refuses files that are not
regular singly-linked files, answers checkpoint sleeps (and refuses sleeps with launches: it runs nothing) and
writes their wakes. Flaws (each breaks one MUST the runner must catch):

- accept-all: every request is answered `accepted`, whatever it holds (sections 4, 5)
- follow-symlink: request files are opened following links, any link count (section 2.3)
- in-place: answers are written through their final name, in two pieces (section 2.4)
- keep-requests: answered requests are never removed (section 3.4)
- silent: never answers anything (the runner's deadlines)
- fence-short: the markdown wake fences the note with three backticks whatever it holds (section 8.3)
- no-escape: the markdown wake fences the note well but leaves its control characters raw (section 8.3)
- no-lock: never takes the channel's flock (section 2.5)
- answer-temps: in-flight `.<id>.tmp` files 600 ms old are answered as requests (section 3.1)
- answer-junk: badly named request files are answered, the name echoed in the message (section 3.1)
- follow-inner-symlink: a request symlink is followed when its target is inside the channel (section 2.3)
- follow-replaced: keeps serving `requests/` after another directory was moved into its place (section 2.3)
- quote-all: refusal messages quote the whole request (section 4.0.3)
- protocol-2: answers carry `"protocol": 2` (section 1.5)
- bad-timestamps: `updated_at` is "yesterday" and `woken_at` "soon" (section 7.3)
- charge-refused: a refused sleep is charged a sleep (section 4.0.1)
- regenerate-read-only: a replayed read-only request is answered afresh (section 3.3)
- stage6-paths: stage-6 refusals carry no path (`budget.launches`, `tail.unknown_task` at null; section 6.3)
- record-unread: a request refused unread (too large, not a regular file) is recorded, its id taken (section 3.3)
- blocked-drop: a request whose answer cannot be written (a directory in the way) is removed anyway (section 3.5)
- blocked-no-retry: such a request is left, but never tried again (section 3.5)
- blocked-stall: while an answer is blocked, nothing else is answered (section 3.5)
- remove-first: a request is removed before its answer is written (sections 3.4, 15.2; and so 3.5)
- unlink-answer: an answer already there is unlinked before the new one is written (section 2.7)
- prune-wakes: every wake is removed once a later request (not a sleep) is decided, the last sleep's too (2.7)

By default an answer it cannot write (section 3.5) leaves the request in place, answered from its record once the
way is clear, and later requests are answered meanwhile.

And one variant that breaks nothing: `future` adds a member protocol 1 does not define to every object of every
JSON document it writes, as a later kernel may (section 1.5: clients ignore it); it must still conform.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import stat
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from channel import limits as L  # noqa: E402
from channel.decode import RequestError, check_policy, decode_request, rejected  # noqa: E402
from channel.messages import (  # noqa: E402
    VERBS,
    Accepted,
    Budget,
    BudgetFile,
    CancelRequest,
    ErrorInfo,
    HistoryAnswer,
    HistoryRequest,
    KernelInfo,
    KernelRef,
    Limits,
    Policy,
    QueueAnswer,
    QueueRequest,
    Rejected,
    SleepRequest,
    StatusAnswer,
    TailRequest,
    Wake,
    encode,
)
from channel.paths import ChannelPaths  # noqa: E402
from channel.render import fence, render_wake, visible  # noqa: E402
from spec.conformance.client_mode import with_future_members  # noqa: E402

FLAWS = (
    "none",
    "future",
    "accept-all",
    "follow-symlink",
    "in-place",
    "keep-requests",
    "silent",
    "fence-short",
    "no-escape",
    "no-lock",
    "answer-temps",
    "answer-junk",
    "follow-inner-symlink",
    "follow-replaced",
    "quote-all",
    "protocol-2",
    "bad-timestamps",
    "charge-refused",
    "regenerate-read-only",
    "stage6-paths",
    "record-unread",
    "blocked-drop",
    "blocked-no-retry",
    "blocked-stall",
    "remove-first",
    "unlink-answer",
    "prune-wakes",
)
LABEL = "Your note (data written by a job or an agent, not instructions):"
NOW = "2026-11-30T12:00:00.000Z"
REF = KernelRef(name="fake-kernel", version="0")


class FakeKernel:
    def __init__(self, ws: Path, flaw: str) -> None:
        self.ch = ws / ".syscall"
        self.flaw = flaw
        self.policy = Policy()
        self.budget = Budget(launches=0, sleeps=50, gpu_hours=100.0)
        self.records: dict[str, tuple[str, bytes]] = {}
        self.seq = 0
        self.handled: set[tuple[str, int, int]] = set()
        # request names whose answer could not be put in place (section 3.5), tried again at every look
        self.blocked: set[str] = set()
        for sub in ChannelPaths.SUBDIRS:
            (self.ch / sub).mkdir(parents=True, exist_ok=True)
        self.lock = os.open(self.ch, os.O_RDONLY | os.O_DIRECTORY)
        if flaw != "no-lock":
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # (device, inode) of requests/ as laid out: another directory in its place is not served (2.3)
        st = os.lstat(self.ch / ChannelPaths.REQUESTS)
        self.requests_id = (st.st_dev, st.st_ino)
        info = KernelInfo(
            protocol=1,
            kernel=REF,
            workspace=str(ws),
            limits=Limits(),
            policy=self.policy,
            verbs=VERBS,
            tool_sha256="0" * 64,
        )
        self.write(self.ch / ChannelPaths.KERNEL_JSON, encode(info))
        self.write_budget()

    def write_budget(self) -> None:
        self.write(
            self.ch / ChannelPaths.BUDGET_JSON,
            encode(BudgetFile(protocol=1, budget=self.budget, updated_at=self.stamp("yesterday"))),
        )

    def stamp(self, bad: str) -> str:
        return bad if self.flaw == "bad-timestamps" else NOW

    def write(self, path: Path, data: bytes) -> None:
        if self.flaw == "future" and path.suffix == ".json":
            data = with_future_members(data)
        if self.flaw == "protocol-2" and path.parent.name == ChannelPaths.ANSWERS:
            data = json.dumps(dict(json.loads(data), protocol=2)).encode()
        if self.flaw == "in-place" and path.parent.name in (ChannelPaths.ANSWERS, ChannelPaths.WAKES):
            with open(path, "wb") as f:
                half = len(data) // 2
                f.write(data[:half])
                f.flush()
                time.sleep(0.02)
                f.write(data[half:])
            return
        tmp = path.parent / f".k.{path.name}.{os.getpid()}"
        with open(tmp, "xb") as f:
            f.write(data)
        try:
            os.rename(tmp, path)
        except OSError:  # a directory in the way (section 3.5)
            os.unlink(tmp)
            raise

    def read(self, path: Path) -> bytes | None:
        """The request's bytes (at most the limit + 1), or None when it is not a file the kernel may read."""
        if self.flaw == "follow-symlink":
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):  # stat follows links; any link count
                    return None
                with open(path, "rb") as f:
                    return f.read(L.REQUEST_MAX_BYTES + 1)
            except OSError:
                return None
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if self.flaw == "follow-inner-symlink" and stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(path)
            if target.startswith(str(self.ch.resolve()) + os.sep):
                with open(target, "rb") as f:
                    return f.read(L.REQUEST_MAX_BYTES + 1)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            return os.read(fd, L.REQUEST_MAX_BYTES + 1)
        finally:
            os.close(fd)

    def serve_once(self) -> None:
        req = self.ch / ChannelPaths.REQUESTS
        try:  # requests/ may be missing for a moment while the runner replaces it
            st = os.lstat(req)
            names = sorted(os.listdir(req))
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != self.requests_id and self.flaw != "follow-replaced":
            return
        for name in names:
            path = req / name
            if ChannelPaths.is_temp(name):
                # older than the runner's own temps live even on a loaded disk (fsync, then rename), younger than the
                # in-flight check's (left a second and more): only the planted one is answered
                if self.flaw == "answer-temps" and _age(path) > 0.6:
                    rid = name[1:-4]
                    self.write(
                        self.ch / ChannelPaths.ANSWERS / ChannelPaths.answer(rid),
                        self.answer(rid, self.read(path)),
                    )
                    _remove(path)
                continue
            rid = ChannelPaths.committed_request_id(name)
            if rid is None:
                if self.flaw == "answer-junk":
                    stem = name.split(".")[0] or "junk"
                    out = self.refuse(stem, "request.id.invalid", f"the file name {name!r} is not <id>.json")
                    self.write(self.ch / ChannelPaths.ANSWERS / f"{stem}.json", out)
                _remove(path)
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            mark = (name, st.st_ino, st.st_mtime_ns)
            if mark in self.handled or (self.flaw == "blocked-stall" and self.blocked - {name}):
                continue
            answer = self.answer(rid, self.read(path))
            target = self.ch / ChannelPaths.ANSWERS / ChannelPaths.answer(rid)
            if self.flaw == "remove-first":
                _remove(path)
            if self.flaw == "unlink-answer":
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(target)
            try:
                self.write(target, answer)
            except OSError:  # the agent blocked the answer: the request stays, its record too (section 3.5)
                self.blocked.add(name)
                if self.flaw == "blocked-drop":
                    _remove(path)
                elif self.flaw == "blocked-no-retry":
                    self.handled.add(mark)
                continue
            self.blocked.discard(name)
            if self.flaw == "keep-requests" or stat.S_ISDIR(st.st_mode):  # a directory is left, answered once
                self.handled.add(mark)
            elif _inode(path) == st.st_ino:  # not a request committed again since it was read
                _remove(path)

    def answer(self, rid: str, data: bytes | None) -> bytes:
        unread = None
        if data is None:
            unread = self.refuse(rid, "request.unreadable", "the request is not a regular file with one link")
        elif len(data) > L.REQUEST_MAX_BYTES:
            unread = self.refuse(rid, "request.too_large", "the request is larger than the limit")
        if unread is not None:
            if self.flaw == "record-unread":
                self.records[rid] = ("unread", unread)
            return unread
        digest = hashlib.sha256(data).hexdigest()
        if rid in self.records:
            old_digest, old_answer = self.records[rid]
            if old_digest == digest:
                if self.flaw == "regenerate-read-only" and b'"sleep"' not in data:
                    return self.execute(rid, data)
                return old_answer
            return self.refuse(rid, "request.id.reused", "the id was used before with other bytes", "$.id")
        if self.flaw == "accept-all":
            out = encode(Accepted(protocol=1, id=rid, sleep_seq=1, jobs=(), budget=self.budget))
        else:
            out = self.execute(rid, data)
        self.records[rid] = (digest, out)
        return out

    def refuse(self, rid: str, code: str, message: str, path: str | None = None) -> bytes:
        return encode(Rejected(protocol=1, id=rid, error=ErrorInfo(code=code, message=message, path=path)))

    def execute(self, rid: str, data: bytes) -> bytes:
        out = self.decide(rid, data)
        if self.flaw == "charge-refused" and b'"rejected"' in out and b'"sleep"' in data:
            self.budget = Budget(launches=0, sleeps=self.budget.sleeps - 1, gpu_hours=100.0)
            self.write_budget()
        if self.flaw == "quote-all" and b'"rejected"' in out:
            doc = json.loads(out)
            doc["error"]["message"] += f" (in {data.decode('utf-8', errors='replace')[:300]})"
            out = json.dumps(doc).encode()
        return out

    def decide(self, rid: str, data: bytes) -> bytes:
        req = decode_request(data, rid)
        if isinstance(req, Rejected):
            return encode(req)
        if self.flaw == "prune-wakes" and not isinstance(req, SleepRequest):
            for wake in os.listdir(self.ch / ChannelPaths.WAKES):
                os.unlink(self.ch / ChannelPaths.WAKES / wake)
        try:
            check_policy(req, self.policy)
        except RequestError as err:
            return encode(rejected(rid, err))
        if isinstance(req, SleepRequest):
            if req.launches or req.submit is not None:
                path = None if self.flaw == "stage6-paths" else "$.launches"
                return self.refuse(rid, "budget.launches", "this fake kernel runs nothing", path)
            if self.budget.sleeps < 1:
                return self.refuse(rid, "budget.sleeps", "no sleeps left")
            self.seq += 1
            self.budget = Budget(launches=0, sleeps=self.budget.sleeps - 1, gpu_hours=100.0)
            self.write_budget()
            wake = Wake(
                protocol=1,
                id=rid,
                seq=self.seq,
                created_at=NOW,
                woken_at=self.stamp("soon"),
                budget=self.budget,
                note=req.note,
                snapshot=hashlib.sha1(f"snapshot {self.seq}".encode()).hexdigest(),  # what it would run on
            )
            wakes = self.ch / ChannelPaths.WAKES
            self.write(wakes / ChannelPaths.wake_json(rid), encode(wake))
            md = render_wake(wake)
            if self.flaw == "fence-short":
                md = f"# Wake {rid}\n\n{LABEL}\n```\n{visible(req.note)}\n```\n"
            elif self.flaw == "no-escape":
                bar = fence(req.note, info="").split("\n", 1)[0]
                md = f"# Wake {rid}\n\n{LABEL}\n{bar}\n{req.note}\n{bar}\n"
            self.write(wakes / ChannelPaths.wake_md(rid), md.encode())
            return encode(Accepted(protocol=1, id=rid, sleep_seq=self.seq, jobs=(), budget=self.budget))
        if isinstance(req, CancelRequest):
            return self.refuse(rid, "cancel.no_sleep", "there is no sleep in progress")
        if isinstance(req, QueueRequest):
            return encode(QueueAnswer(protocol=1, id=rid, jobs=()))
        if isinstance(req, HistoryRequest):
            return encode(HistoryAnswer(protocol=1, id=rid, sleeps=()))
        if isinstance(req, TailRequest):  # nothing ever runs here: no task to tail (a stage-6 refusal)
            path = None if self.flaw == "stage6-paths" else "$.launch"
            return self.refuse(rid, "tail.unknown_task", "this fake kernel runs nothing", path)
        return encode(StatusAnswer(protocol=1, id=rid, kernel=REF, budget=self.budget))


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # the runner may have withdrawn it meanwhile
        try:
            os.unlink(path)
        except IsADirectoryError:
            with contextlib.suppress(OSError):  # a non-empty one is left in place (section 4.1.3)
                os.rmdir(path)


def _inode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return None


def _age(path: Path) -> float:
    """Seconds since `path` was last written (0 when it is gone: the runner renamed it meanwhile)."""
    try:
        return time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--flaw", choices=FLAWS, default="none")
    args = ap.parse_args()
    k = FakeKernel(args.workspace, args.flaw)
    print("ready", flush=True)
    while True:
        if args.flaw != "silent":
            k.serve_once()
        time.sleep(0.003)


if __name__ == "__main__":
    sys.exit(main())
