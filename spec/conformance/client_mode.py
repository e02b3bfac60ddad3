"""`syscall-conformance client`: run a client in a scratch channel and check every request it commits.

The scratch channel is a fresh `<tmp>/workspace/.syscall/` with the directories of section 2.1 and a `kernel.json`
and `budget.json` as a kernel would write them (the protocol's limits, the default policy). No kernel answers
there: a client that waits for answers times out, which is not a fault, but it must time out by itself (section
15.3: a client bounds every wait). The command runs with `sh -c` in the workspace, with `SYSCALL_CHANNEL` and
`SYSCALL_WORKSPACE` set, under a time limit (its process group is killed after it, and a command killed so did
not bound its wait). inotify records how each file arrived; each committed request is read the moment it arrives, every
time it arrives, so a client that withdraws it later, or commits other bytes under the same name, is still judged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from channel import limits as L
from channel.decode import is_valid_id
from channel.messages import (
    VERBS,
    Budget,
    BudgetFile,
    KernelInfo,
    KernelRef,
    Limits,
    Policy,
    encode,
)
from channel.paths import CHANNEL_DIR, ChannelPaths
from spec.conformance import checks
from spec.conformance.inotify import IN_CLOSE_WRITE, IN_MOVED_TO, Event, Unavailable, Watcher
from spec.conformance.report import Result, failed, not_run, passed

SCRATCH_KERNEL: Final = KernelRef(name="syscall-conformance", version="scratch")
TIMESTAMP: Final = "2026-01-01T00:00:00.000Z"
_KERNEL_FILES: Final = (ChannelPaths.KERNEL_JSON, ChannelPaths.BUDGET_JSON)


@dataclass(frozen=True, slots=True)
class Options:
    command: str
    timeout: float = 60.0
    keep: bool = False


class _Capture:
    """Reads each request file the moment inotify says it arrived (before the client can withdraw it)."""

    def __init__(self, requests: Path, watcher: Watcher) -> None:
        self.requests = requests
        self.watcher = watcher
        # every arrival of a committed name, in order, with the bytes read when it arrived
        self.arrivals: list[tuple[str, bytes | None]] = []
        self._cursor = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conformance-capture", daemon=True)

    def __enter__(self) -> _Capture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)
        self.poll()

    def _run(self) -> None:
        while not self._done.wait(0.002):
            self.poll()

    def poll(self) -> None:
        events = self.watcher.events()  # every event so far: those past the cursor are new
        new, self._cursor = events[self._cursor :], len(events)
        for e in new:
            if e.directory != str(self.requests) or ChannelPaths.is_temp(e.name):
                continue
            if e.mask & (IN_MOVED_TO | IN_CLOSE_WRITE):
                self.arrivals.append((e.name, _read_request(self.requests / e.name)))


# Section 1.5: a client MUST ignore members it does not know, so the scratch channel's documents carry one in
# every object, as a later kernel's might.
FUTURE_MEMBER: Final = "x_conformance_future"


def with_future_members(data: bytes) -> bytes:
    """`data` (a JSON document) with `FUTURE_MEMBER` added to each of its objects."""

    def add(doc: object) -> object:
        if isinstance(doc, dict):
            return {**{k: add(v) for k, v in doc.items()}, FUTURE_MEMBER: {"since": 2}}
        if isinstance(doc, list):
            return [add(v) for v in doc]
        return doc

    return json.dumps(add(json.loads(data)), ensure_ascii=False).encode("utf-8") + b"\n"


def scratch_channel(root: Path) -> Path:
    """A channel as a kernel lays it out (section 2.1), with the protocol's limits and the default policy, its
    documents carrying a member in each object that protocol 1 does not define (section 1.5)."""
    ws = root / "workspace"
    ch = ws / CHANNEL_DIR
    for sub in ChannelPaths.SUBDIRS:
        (ch / sub).mkdir(parents=True)
    info = KernelInfo(
        protocol=L.PROTOCOL_VERSION,
        kernel=SCRATCH_KERNEL,
        workspace=str(ws),
        limits=Limits(),
        policy=Policy(),
        verbs=VERBS,
        tool_sha256="0" * 64,
    )
    budget = Budget(
        launches=L.BUDGET_LAUNCHES,
        sleeps=L.BUDGET_SLEEPS,
        gpu_hours=L.BUDGET_GPU_HOURS,
        reserved_gpu_hours=0.0,
    )
    (ch / ChannelPaths.KERNEL_JSON).write_bytes(with_future_members(encode(info)))
    (ch / ChannelPaths.BUDGET_JSON).write_bytes(
        with_future_members(
            encode(BudgetFile(protocol=L.PROTOCOL_VERSION, budget=budget, updated_at=TIMESTAMP))
        )
    )
    return ch


def run_client(opts: Options) -> tuple[list[Result], str]:
    """The results, and how the command ended with its output (stdout and stderr, last 4000 characters)."""
    root = Path(tempfile.mkdtemp(prefix="syscall-conformance-client-"))
    try:
        results, output = _run(root, opts)
        return results, output + (f"\nthe scratch directory is kept: {root}\n" if opts.keep else "")
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)


def _run(root: Path, opts: Options) -> tuple[list[Result], str]:
    ch = scratch_channel(root)
    ws = ch.parent
    requests = ch / ChannelPaths.REQUESTS
    kernel_files = {n: (ch / n).read_bytes() for n in _KERNEL_FILES}
    watched = [str(ch)] + [str(ch / s) for s in ChannelPaths.SUBDIRS]
    try:
        watcher = Watcher(watched)
    except Unavailable as exc:
        return [not_run("3.1", "client run", f"inotify is needed to see how files arrive: {exc}")], ""
    results: list[Result] = []
    with watcher, _Capture(requests, watcher) as capture:
        output, status, killed = _execute(opts, ws, ch)
        # what the client left in requests/ after it exited, read now (covers writes the watch raced with)
        seen = {n for n, _ in capture.arrivals}
        for name in os.listdir(requests):
            if not ChannelPaths.is_temp(name) and name not in seen:
                capture.arrivals.append((name, _read_request(requests / name)))
    events = watcher.events()
    if not capture.arrivals:
        why = (
            "no file was committed to requests/ (kernel.json and budget.json carry a member "
            f"{FUTURE_MEMBER!r} in every object, which a client MUST ignore: section 1.5)"
        )
        results.append(failed("14.1", "the client committed a request", why))
    by_name: dict[str, list[bytes | None]] = {}
    for name, data in capture.arrivals:
        by_name.setdefault(name, []).append(data)
    for name in sorted(by_name):
        results.extend(_judge_name(name, by_name[name], events, str(requests)))
    results.append(_kernel_area(ch, kernel_files, events))
    results.append(_bounded(status, killed, opts.timeout))
    return results, f"the client command: {status}\n{output}"


BOUNDED_CHECK: Final = "the client bounds its wait when no kernel answers"


def _bounded(status: str, killed: bool, timeout: float) -> Result:
    """Section 15.3: no kernel answers in the scratch channel, so a client that waits for an answer or a wake
    must give up by itself; one still running at the limit is taken not to bound its wait."""
    if killed:
        why = (
            f"the command was still running at the {timeout:g} s limit with no kernel answering: a client MUST "
            "bound every wait (15.3); give it a timeout of its own shorter than --timeout"
        )
        return failed("15.3", BOUNDED_CHECK, why)
    return passed("15.3", BOUNDED_CHECK, f"it ended by itself: {status}")


def _execute(opts: Options, ws: Path, ch: Path) -> tuple[str, str, bool]:
    """Run the command: its output, how it ended, and whether it was killed at the limit. The output goes to a
    file, so a background process holding it open cannot stall us."""
    env = dict(os.environ, SYSCALL_CHANNEL=str(ch), SYSCALL_WORKSPACE=str(ws))
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            ["sh", "-c", opts.command],
            cwd=ws,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        killed = False
        try:
            proc.wait(timeout=opts.timeout)
            status = f"exit status {proc.returncode} after {time.monotonic() - start:.1f} s"
        except subprocess.TimeoutExpired:
            status = f"killed after the {opts.timeout:g} s limit"
            killed = True
        # the whole session goes, including what the command left running in the background
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out.seek(0, os.SEEK_END)
        out.seek(max(0, out.tell() - 16000))
        text = out.read().decode("utf-8", errors="replace")[-4000:]
    return text, status, killed


def _judge_name(name: str, arrivals: list[bytes | None], events: list[Event], requests: str) -> list[Result]:
    """The name (3.2), how it arrived each time (3.1), the bytes of every arrival (the first judged as
    `<name>: ...`, the k-th as `<name> (arrival k): ...`), and for a name that arrived more than once, that it
    brought the same bytes each time (3.2: an id is never reused for different content; re-committing the same
    bytes is how a client retries, 3.3)."""
    stem = name[:-5] if name.endswith(".json") else name
    if not name.endswith(".json") or not is_valid_id(stem):
        why = f"{name!r} is not <id>.json with an id matching {L.ID_PATTERN}; a kernel drops it unanswered"
        return [failed("3.2", f"{name}: id well formed", why)]
    out = [passed("3.2", f"{name}: id well formed", "matches the id pattern")]
    temp = ChannelPaths.request_temp(stem)
    problem = checks.commit_problem(events, requests, name, temp)
    check = f"{name}: temp, then rename"
    out.append(failed("3.1", check, problem) if problem else passed("3.1", check, f"renamed from {temp}"))
    for k, data in enumerate(arrivals, start=1):
        label = name if k == 1 else f"{name} (arrival {k})"
        if data is None:
            why = "the file was gone (or unreadable) before it could be read"
            out.append(not_run("4", f"{label}: contents", why))
            continue
        for section, what, issue in checks.request_problems(stem, data):
            out.append(
                failed(section, f"{label}: {what}", issue)
                if issue
                else passed(section, f"{label}: {what}", "ok")
            )
    if len(arrivals) > 1:
        check = f"{name}: never reused for other content"
        contents = {d for d in arrivals if d is not None}
        out.append(
            failed("3.2", check, f"{len(arrivals)} arrivals brought {len(contents)} different contents")
            if len(contents) > 1
            else passed("3.2", check, f"{len(arrivals)} arrivals, the same bytes each time")
        )
    return out


def _kernel_area(ch: Path, before: dict[str, bytes], events: list[Event]) -> Result:
    """Section 2.4: clients never write answers/, wakes/, results/, kernel.json or budget.json."""
    name = "the client writes nothing kernel-owned"
    touched = sorted(
        {
            f"{Path(e.directory).name}/{e.name}"
            for e in events
            if e.directory
            in {str(ch / s) for s in (ChannelPaths.ANSWERS, ChannelPaths.WAKES, ChannelPaths.RESULTS)}
        }
    )
    changed = [n for n, data in before.items() if _read_request(ch / n) != data]
    if touched or changed:
        return failed("2.4", name, f"the client wrote {', '.join(touched + changed)[:200]}")
    return passed("2.4", name, "answers/, wakes/, results/, kernel.json, budget.json untouched")


def _read_request(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, L.REQUEST_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
