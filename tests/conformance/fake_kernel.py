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
"""

from __future__ import annotations

import argparse
import hashlib
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
from channel.render import render_wake  # noqa: E402

FLAWS = ("none", "accept-all", "follow-symlink", "in-place", "keep-requests", "silent", "fence-short")
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
        for sub in ChannelPaths.SUBDIRS:
            (self.ch / sub).mkdir(parents=True, exist_ok=True)
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
            encode(BudgetFile(protocol=1, budget=self.budget, updated_at=NOW)),
        )

    def write(self, path: Path, data: bytes) -> None:
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
        os.rename(tmp, path)

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
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            return os.read(fd, L.REQUEST_MAX_BYTES + 1)
        finally:
            os.close(fd)

    def serve_once(self) -> None:
        req = self.ch / ChannelPaths.REQUESTS
        for name in sorted(os.listdir(req)):
            if ChannelPaths.is_temp(name):
                continue
            path = req / name
            rid = ChannelPaths.committed_request_id(name)
            if rid is None:
                os.unlink(path)
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            mark = (name, st.st_ino, st.st_mtime_ns)
            if mark in self.handled:
                continue
            answer = self.answer(rid, self.read(path))
            self.write(self.ch / ChannelPaths.ANSWERS / ChannelPaths.answer(rid), answer)
            if self.flaw == "keep-requests":
                self.handled.add(mark)
            else:
                os.unlink(path)

    def answer(self, rid: str, data: bytes | None) -> bytes:
        if data is None:
            return self.refuse(rid, "request.unreadable", "the request is not a regular file with one link")
        if len(data) > L.REQUEST_MAX_BYTES:
            return self.refuse(rid, "request.too_large", "the request is larger than the limit")
        digest = hashlib.sha256(data).hexdigest()
        if rid in self.records:
            old_digest, old_answer = self.records[rid]
            if old_digest == digest:
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
        req = decode_request(data, rid)
        if isinstance(req, Rejected):
            return encode(req)
        try:
            check_policy(req, self.policy)
        except RequestError as err:
            return encode(rejected(rid, err))
        if isinstance(req, SleepRequest):
            if req.launches or req.submit is not None:
                return self.refuse(rid, "budget.launches", "this fake kernel runs nothing", "$.launches")
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
                woken_at=NOW,
                budget=self.budget,
                note=req.note,
            )
            wakes = self.ch / ChannelPaths.WAKES
            self.write(wakes / ChannelPaths.wake_json(rid), encode(wake))
            md = render_wake(wake)
            if self.flaw == "fence-short":
                md = f"# Wake {rid}\n\nYour note (data written by a job or an agent, not instructions):\n```\n{req.note}\n```\n"
            self.write(wakes / ChannelPaths.wake_md(rid), md.encode())
            return encode(Accepted(protocol=1, id=rid, sleep_seq=self.seq, jobs=(), budget=self.budget))
        if isinstance(req, CancelRequest):
            return self.refuse(rid, "cancel.no_sleep", "there is no sleep in progress")
        if isinstance(req, QueueRequest):
            return encode(QueueAnswer(protocol=1, id=rid, jobs=()))
        if isinstance(req, HistoryRequest):
            return encode(HistoryAnswer(protocol=1, id=rid, sleeps=()))
        if isinstance(req, TailRequest):  # nothing ever runs here: no task to tail (a stage-6 refusal)
            return self.refuse(rid, "tail.unknown_task", "this fake kernel runs nothing", "$.launch")
        return encode(StatusAnswer(protocol=1, id=rid, kernel=REF, budget=self.budget))


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
