"""Pickup latency: a `status` request renamed into requests/ -> its answer renamed into answers/.

For each workspace count (1, 100, 1000) and watch mode (inotify, poll) a real kernel process serves N enrolled
git workspaces; one request at a time goes to a random workspace. The clock starts just before the rename and
stops when this process's own inotify reports the answer's rename (no busy polling, so the bench does not steal
the kernel's CPU). In the same run, a 2-second polling loop (the design of the best existing system) answers the
same kind of request through the same harness, as the baseline. Also measured: the floor set by one durable
atomic write on this disk, and the kernel's RSS, peak RSS and thread count. Sampling starts once the start-up
work that runs after `ready` is over (`event=channels_refreshed`, `event=bases_checked`); `settled_s` says how
long that took, and `--no-settle` samples at once. The workspaces have no commit, so there is no base to import
then (bench/startup.py measures that import). `--during-import` instead gives each workspace a commit and samples
from `ready` until `event=bases_checked`: the pickup while a first start imports every workspace's base in the
background (only the samples answered before that event count).

Prints one JSON object per scenario. Usage:
    .venv/bin/python bench/pickup.py [--workspaces 1,100,1000] [--samples 500] [--poll-samples 150]
                                     [--baseline-samples 30] [--modes inotify,poll] [--no-settle]
                                     [--during-import]
                                     [--kernel-root OLD_CHECKOUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import select
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernelproc import ROOT, Kernel, make_workspaces, warm_imports, write_config

IN_MOVED_TO = 0x80
_libc = ctypes.CDLL(None, use_errno=True)


class Inotify:
    """A minimal inotify reader: one fd, one watch per answers/ directory."""

    def __init__(self) -> None:
        self.fd = _libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.pending: list[tuple[int, str]] = []

    def watch(self, path: Path) -> int:
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), IN_MOVED_TO)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
        return int(wd)

    def wait(self, wd: int, name: str, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while True:
            for i, (w, n) in enumerate(self.pending):
                if w == wd and n == name:
                    del self.pending[i]
                    return True
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                buf = os.read(self.fd, 65536)
                i = 0
                while i + 16 <= len(buf):
                    w, _mask, _cookie, length = struct.unpack_from("iIII", buf, i)
                    raw = buf[i + 16 : i + 16 + length].rstrip(b"\0")
                    self.pending.append((w, raw.decode()))
                    i += 16 + length

    def close(self) -> None:
        os.close(self.fd)


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))] * 1000, 3)

    return {
        "p50_ms": round(statistics.median(s) * 1000, 3),
        "p90_ms": q(0.90),
        "p99_ms": q(0.99),
        "max_ms": round(s[-1] * 1000, 3),
    }


def measure(
    spaces: list[Path], samples: int, timeout: float, seed: int, arrival_s: float = 0.0
) -> list[float]:
    """Latency of `samples` requests, one at a time; each arrives after a random pause of up to `arrival_s`, so
    that requests are not in phase with a polling loop (which would make every wait a full interval)."""
    ino = Inotify()
    wds = [ino.watch(ws / ".syscall" / "answers") for ws in spaces]
    rng = random.Random(seed)
    out: list[float] = []
    try:
        for k in range(samples):
            i = rng.randrange(len(spaces))
            if arrival_s:
                time.sleep(rng.uniform(0, arrival_s))
            rid = f"b{seed}-{k:05d}-{time.monotonic_ns() % 10**9}"
            req = spaces[i] / ".syscall" / "requests"
            tmp = req / f".{rid}.tmp"
            tmp.write_bytes(json.dumps({"protocol": 1, "id": rid, "type": "status"}).encode())
            t0 = time.perf_counter()
            os.rename(tmp, req / f"{rid}.json")
            if not ino.wait(wds[i], f"{rid}.json", timeout):
                raise SystemExit(f"no answer to {rid} within {timeout} s")
            out.append(time.perf_counter() - t0)
    finally:
        ino.close()
    return out


def measure_during_import(k: Kernel, spaces: list[Path]) -> tuple[list[float], float]:
    """Requests in rounds of 20 from `ready` until the log says every base is imported; the latencies of the
    rounds that ended before that (the import was running throughout them) and the import's duration."""
    t0 = time.perf_counter()
    out: list[float] = []
    seed = 0
    while not k.count(b"event=bases_checked"):
        seed += 1
        lat = measure(spaces, 20, 30, seed=seed, arrival_s=0.01)
        if not k.count(b"event=bases_checked"):
            out.extend(lat)
    return out, round(time.perf_counter() - t0, 2)


def proc_status(pid: int) -> dict[str, float]:
    fields: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = round(int(rest.split()[0]) / 1024, 1)
            elif key == "Threads":
                fields[key] = int(rest)
    return fields


class Baseline2s:
    """The anchor's design: every 2 s, list every channel and answer what is there."""

    def __init__(self, spaces: list[Path]) -> None:
        self.spaces = spaces
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stopped.wait(2.0):
            for ws in self.spaces:
                req = ws / ".syscall" / "requests"
                for name in os.listdir(req):
                    if name.endswith(".json"):
                        rid = name[:-5]
                        body = json.dumps({"protocol": 1, "id": rid, "type": "status"}).encode()
                        tmp = ws / ".syscall" / "answers" / f".base-{rid}.tmp"
                        with open(tmp, "wb") as f:
                            f.write(body)
                            os.fsync(f.fileno())
                        os.rename(tmp, ws / ".syscall" / "answers" / name)
                        os.unlink(req / name)


def fsync_floor(directory: Path, n: int = 300) -> dict[str, float]:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        tmp = directory / f".floor-{i}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"x" * 300)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, directory / "floor.json")
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workspaces", default="1,100,1000")
    ap.add_argument("--modes", default="inotify,poll")
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--poll-samples", type=int, default=150)
    ap.add_argument("--baseline-samples", type=int, default=30)
    ap.add_argument("--poll-seconds", type=float, default=0.5)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument(
        "--no-settle",
        action="store_true",
        help="sample right after `ready` (with the start-up work after it)",
    )
    ap.add_argument(
        "--during-import",
        action="store_true",
        help="workspaces with a commit; sample from `ready` until every base is imported (event=bases_checked)",
    )
    ap.add_argument(
        "--kernel-root",
        type=Path,
        help="run the kernel of this checkout instead (an older commit, for a before/after pair; with "
        "--no-settle if it predates event=bases_checked)",
    )
    args = ap.parse_args()

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")  # so that `finally` stops the kernel and cleans up

    signal.signal(signal.SIGTERM, terminated)
    top = Path(tempfile.mkdtemp(prefix="syscall-pickup-"))
    try:
        kernel_root = args.kernel_root.resolve() if args.kernel_root else ROOT
        warm_imports(kernel_root)
        floor = fsync_floor(top)
        print(
            json.dumps(
                {"scenario": "floor: durable atomic write (create, fsync, rename, fsync dir)", **floor}
            )
        )
        for n in (int(x) for x in args.workspaces.split(",")):
            root = top / f"n{n}"
            # No commit: nothing for the kernel to import after `ready` (bench/startup.py measures that);
            # with --during-import one commit each, whose import runs while the requests are timed.
            spaces = make_workspaces(root / "agents", n, commit=args.during_import)
            kernel_p50: dict[str, float] = {}
            for mode in args.modes.split(","):
                extra = f'watch = "{mode}"\npoll_seconds = {args.poll_seconds}\n'
                k = Kernel(
                    write_config(root / f"config-{mode}.toml", root / "state", root / "agents", extra),
                    root / f"kernel-{mode}.log",
                    kernel_root,
                )
                ready_s = k.start_ready()
                assert k.proc is not None
                try:
                    settled_s = None
                    if args.during_import:
                        lat, imported_s = measure_during_import(k, spaces)
                    elif not args.no_settle:
                        # Sample the steady state: the start-up work that runs after `ready` (kernel files
                        # refreshed, an automatic enrollment's bases imported: a git process per workspace)
                        # is over. bench/startup.py measures that work.
                        t0 = time.perf_counter()
                        k.wait(b"event=channels_refreshed", 1, every=0.1)
                        k.wait(b"event=bases_checked", 1, every=0.1)
                        settled_s = round(time.perf_counter() - t0, 2)
                    if not args.during_import:
                        samples = args.samples if mode == "inotify" else args.poll_samples
                        measure(spaces, 20, 10, seed=1)  # warm-up
                        arrival = 0.01 if mode == "inotify" else args.poll_seconds
                        lat = measure(spaces, samples, 10, seed=n, arrival_s=arrival)
                    ps = proc_status(k.proc.pid)
                finally:
                    k.stop()
                stats = percentiles(lat)
                kernel_p50[mode] = stats["p50_ms"]
                print(
                    json.dumps(
                        {
                            "scenario": f"kernel {mode}",
                            "workspaces": n,
                            "samples": len(lat),
                            **stats,
                            "rss_mb": ps.get("VmRSS"),
                            "peak_rss_mb": ps.get("VmHWM"),
                            "threads": ps.get("Threads"),
                            "ready_s": round(ready_s, 2),
                            "settled_s": settled_s,
                            **({"bases_imported_s": imported_s} if args.during_import else {}),
                            "loadavg_1m": round(os.getloadavg()[0], 2),
                            **({"poll_seconds": args.poll_seconds} if mode == "poll" else {}),
                        }
                    ),
                    flush=True,
                )
            if args.baseline_samples:
                base = Baseline2s(spaces)
                base.thread.start()
                try:
                    lat = measure(spaces, args.baseline_samples, 10, seed=n + 7, arrival_s=2.0)
                finally:
                    base.stopped.set()
                    base.thread.join()
                stats = percentiles(lat)
                ratios = {
                    f"ratio_p50_vs_{m}": round(stats["p50_ms"] / v, 1) for m, v in kernel_p50.items() if v > 0
                }
                print(
                    json.dumps(
                        {
                            "scenario": "baseline 2 s polling loop",
                            "workspaces": n,
                            "samples": len(lat),
                            **stats,
                            **ratios,
                        }
                    ),
                    flush=True,
                )
    finally:
        if args.keep:
            print(json.dumps({"kept": str(top)}), file=sys.stderr)
        else:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
