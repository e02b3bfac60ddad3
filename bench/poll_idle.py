"""Polling at scale: the kernel's CPU while N polled channels sit idle, and the pickup of an active one.

A real kernel process serves N enrolled git workspaces with `watch = "poll"` (the HPC default on NFS, Lustre and
GPFS, where a write on another host raises no inotify event). Once the start-up work after `ready` is over
(`event=channels_refreshed`; the workspaces have no commit, so no base to import) and the looks have converged
(every channel listed once after its first look: with `--metrics`, no look has listed one for 3 s, from the
kernel's `syscall_kernel_poll_looks_total`; without, 5 s + 1 s per 300 channels, as long as that took), the
bench reads the kernel's CPU time (utime + stime from
/proc/<pid>/stat) over `--idle-s` seconds with nothing arriving, and counts its threads. Then it sends
`--samples` status requests to one workspace, each after a random pause of up to `--poll-seconds` (so requests
are not in phase with the poll), and times each from the rename to the answer's appearance (checked every 1 ms).
That workspace is "active": it has just had requests. Last, one request to a workspace idle since the start
measures what a channel that wakes from a long silence waits.

Prints one JSON object per workspace count. Usage:
    .venv/bin/python bench/poll_idle.py [--workspaces 100,1000,10000] [--idle-s 20] [--samples 40]
                                        [--poll-seconds 0.5] [--rescan-seconds 30] [--kernel-root CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernelproc import ROOT, Kernel, make_workspaces, warm_imports, write_config

_TICKS: float = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def poll_looks(port: int) -> tuple[int, int]:
    """(looks counted `unchanged`, looks counted `listed`) from the kernel's metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    got = dict(re.findall(r'^syscall_kernel_poll_looks_total\{outcome="(\w+)"\} (\S+)$', text, re.M))
    return int(float(got.get("unchanged", 0))), int(float(got.get("listed", 0)))


def settle(port: int, limit: float = 600) -> float:
    """Seconds until no look has listed a channel for 3 s."""
    t0 = time.perf_counter()
    last, since = poll_looks(port)[1], time.perf_counter()
    while time.perf_counter() - since < 3:
        if time.perf_counter() - t0 > limit:
            raise SystemExit("the polled channels never settled")
        time.sleep(0.5)
        now = poll_looks(port)[1]
        if now != last:
            last, since = now, time.perf_counter()
    return time.perf_counter() - t0


def converge_by_time(n: int) -> float:
    """Without the metrics endpoint: wait as long as convergence took with it (27 s at 10,000 channels)."""
    wait = 5 + n / 300
    time.sleep(wait)
    return wait


def pickup_ms(ws: Path, rid: str) -> float:
    requests, answers = ws / ".syscall" / "requests", ws / ".syscall" / "answers"
    tmp = requests / f".{rid}.tmp"
    tmp.write_text(json.dumps({"protocol": 1, "id": rid, "type": "status"}))
    answer = answers / f"{rid}.json"
    t0 = time.perf_counter()
    os.rename(tmp, requests / f"{rid}.json")
    deadline = t0 + 120
    while not answer.exists():
        if time.perf_counter() > deadline:
            raise SystemExit(f"no answer to {rid} in {ws} within 120 s")
        time.sleep(0.001)
    ms = (time.perf_counter() - t0) * 1000
    answer.unlink()
    return ms


def scenario(base: Path, n: int, args: argparse.Namespace, root: Path) -> dict[str, object]:
    spaces = base / f"spaces-{n}"
    workspaces = make_workspaces(spaces, n, commit=False)
    state = base / f"state-{n}"
    shutil.rmtree(state, ignore_errors=True)
    for ws in workspaces:  # kept from an earlier run (`--keep`): their channels name the store just removed
        shutil.rmtree(ws / ".syscall", ignore_errors=True)
    port = free_port()
    extra = (
        f'watch = "poll"\npoll_seconds = {args.poll_seconds}\nrescan_seconds = {args.rescan_seconds}\n'
        f'backend = "none"\njail = "none"\nmetrics_listen = "127.0.0.1:{port}"\n'
        if args.metrics
        else ""
    )
    extra = extra or (
        f'watch = "poll"\npoll_seconds = {args.poll_seconds}\nrescan_seconds = {args.rescan_seconds}\n'
        'backend = "none"\njail = "none"\n'
    )
    config = write_config(base / f"config-{n}.toml", state, spaces, extra)
    log = base / f"kernel-{n}.log"
    log.unlink(missing_ok=True)
    k = Kernel(config, log, root)
    try:
        return measure(k, n, workspaces, args, port)
    finally:
        if k.proc is not None and k.proc.poll() is None:  # a measurement failed: no kernel left serving
            k.proc.kill()
            k.proc.wait(30)


def measure(
    k: Kernel, n: int, workspaces: list[Path], args: argparse.Namespace, port: int
) -> dict[str, object]:
    t0 = time.perf_counter()
    k.start_ready()
    k.wait(b"event=channels_refreshed", 1)
    settled_s = time.perf_counter() - t0
    assert k.proc is not None
    pid = k.proc.pid
    # Converged: every channel listed once after its first look (its stamp trusted), so no look lists any more.
    converged_s = settle(port) if args.metrics else converge_by_time(n)
    looks0 = poll_looks(port) if args.metrics else (0, 0)
    c0, w0 = cpu_seconds(pid), time.perf_counter()
    time.sleep(args.idle_s)
    window = time.perf_counter() - w0
    idle_cpu = (cpu_seconds(pid) - c0) / window
    looks1 = poll_looks(port) if args.metrics else (0, 0)
    idle_threads, idle_rss = threads(pid), rss_mb(pid)
    active = workspaces[0]
    pickup_ms(active, "warm")  # after the idle window: this one wakes it (as `pickup_after_idle_ms` measures)
    samples = []
    for i in range(args.samples):
        time.sleep(random.uniform(0, args.poll_seconds))
        samples.append(pickup_ms(active, f"a{i:04d}"))
    samples.sort()
    woken = pickup_ms(workspaces[-1], "w0000")
    rc, _ = k.stop()
    return {
        "workspaces": n,
        "poll_seconds": args.poll_seconds,
        "rescan_seconds": args.rescan_seconds,
        "settled_s": round(settled_s, 1),
        "converged_s": round(converged_s, 1),
        "idle_cpu_pct_of_core": round(100 * idle_cpu, 1),
        "looks_per_s": round((looks1[0] - looks0[0]) / window),
        "listings_in_window": looks1[1] - looks0[1],
        "threads": idle_threads,
        "rss_mb": round(idle_rss, 1),
        "active_pickup_ms": {
            "p50": round(statistics.median(samples), 1),
            "p90": round(samples[int(0.9 * (len(samples) - 1))], 1),
            "max": round(samples[-1], 1),
            "samples": len(samples),
        },
        "pickup_after_idle_ms": round(woken, 1),
        "exit_code": rc,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspaces", default="100,1000,10000")
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--poll-seconds", type=float, default=0.5)
    ap.add_argument("--rescan-seconds", type=float, default=30.0)
    ap.add_argument(
        "--metrics",
        action="store_true",
        help="serve metrics: settle on the looks counter and report looks/s (its per-workspace gauges are "
        "refreshed every 5 s, which costs the kernel CPU of its own at 10,000 workspaces)",
    )
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    ap.add_argument("--kernel-root", default=str(ROOT), help="the checkout whose kernel runs (before/after)")
    args = ap.parse_args()
    root = Path(args.kernel_root).resolve()
    warm_imports(root)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="poll-idle-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        for n in (int(x) for x in args.workspaces.split(",")):
            print(json.dumps(scenario(base, n, args, root)), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
