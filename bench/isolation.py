"""No workspace can stall another: workspace B's `status` latency while workspace A does something heavy.

A real `syscall-kernel serve` (local backend, `jail = "none"`) serves two enrolled workspaces, A and B. B commits
a `status` request every 100 ms (each waits for its answer, polled every 1 ms) for as long as A's case lasts;
the bench prints B's latency (request renamed -> `answers/<id>.json` present), p50/p99/max, per case:

- (a) `artifacts`: A sleeps with 4 launches, each writing 4 artifacts of 64 MiB (1 GiB in all), gathered into
  A's channel when they end; measured from A's sleep to A's wake.
- (b) `snapshot`: A's workspace holds 20,000 directories (one small file each) and A sleeps (`true`): the
  snapshot walks them; measured from A's sleep to A's `accepted` answer.
- (c) `temps`: A's `requests/` holds 100,000 temp names (`.<x>.tmp`, in flight), 50 of them touched every
  20 ms, for 10 s (with `--rescan-seconds 5`, the default, two full listings of A's `requests/` fall in it).
- `idle`: the floor, measured in the same run: B's latency for 10 s while A does nothing.

Target: max <= 200 ms in each case. Usage:
    .venv/bin/python bench/isolation.py [--cases idle,artifacts,snapshot,temps] [--dirs 20000] [--temps 100000]
                                        [--rescan-seconds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from kernelproc import git  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def wait_until(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.001)


def put(ws: Path, rid: str, body: dict[str, object]) -> Path:
    rq = ws / ".syscall" / "requests"
    tmp = rq / f".{rid}.tmp"
    tmp.write_text(json.dumps({"protocol": 1, "id": rid, **body}))
    os.rename(tmp, rq / f"{rid}.json")
    return ws / ".syscall" / "answers" / f"{rid}.json"


class Prober(threading.Thread):
    """B's status every 100 ms until stopped; the latencies in ms."""

    def __init__(self, ws: Path, tag: str) -> None:
        super().__init__(daemon=True)
        self.ws, self.tag = ws, tag
        self.stop = threading.Event()
        self.ms: list[float] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            t0 = time.perf_counter()
            answer = put(self.ws, f"{self.tag}-{i}", {"type": "status"})
            wait_until(answer.exists, 120)
            self.ms.append((time.perf_counter() - t0) * 1000)
            self.stop.wait(max(0.0, 0.1 - (time.perf_counter() - t0)))


class Kernel:
    def __init__(self, top: Path, rescan_seconds: float) -> None:
        self.top = top
        self.config = top / "config.toml"
        self.config.write_text(
            ("allow_root = true\n" if os.geteuid() == 0 else "")
            + f'state_dir = "{top}/state"\njail = "none"\nbackend = "local"\n'
            + f"rescan_seconds = {rescan_seconds}\n[local]\nmax_parallel = 8\n"
        )
        self.log = top / "kernel.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def cli(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "kernel.cli", *args, "--config", str(self.config)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kernel.cli", "serve", "--config", str(self.config)],
                cwd=ROOT,
                stdout=log,
                stderr=log,
                env=env,
            )
        wait_until(lambda: b"event=ready" in self.log.read_bytes(), 120)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def workspace(path: Path, dirs: int = 0) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    (path / "README").write_text("bench\n")
    for i in range(dirs):
        d = path / f"d{i // 1000:02d}" / f"s{i:05d}"
        d.mkdir(parents=True)
        (d / "f").write_text(str(i))
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "bench")
    return path


def measure(case: str, b: Path, during: Callable[[], None]) -> dict[str, object]:
    probe = Prober(b, "p" + case[0])
    probe.start()
    t0 = time.monotonic()
    try:
        during()
    finally:
        probe.stop.set()
        probe.join(60)
    xs = probe.ms
    return {
        "case": case,
        "seconds": round(time.monotonic() - t0, 1),
        "samples": len(xs),
        "p50_ms": round(statistics.median(xs), 2),
        "p99_ms": round(pct(xs, 99), 2),
        "max_ms": round(max(xs), 2),
    }


def case_artifacts(a: Path, b: Path) -> dict[str, object]:
    cmd = "for i in 0 1 2 3; do head -c 67108864 /dev/zero > a$i.bin; done"
    launches = [
        {"name": f"l{k}", "command": cmd, "minutes": 10, "artifacts": [f"a{i}.bin" for i in range(4)]}
        for k in range(4)
    ]

    def during() -> None:
        put(a, "art", {"type": "sleep", "launches": launches})
        wait_until((a / ".syscall" / "wakes" / "art.json").exists, 600)

    row = measure("a: 1 GiB of artifacts gathered", b, during)
    # The wake file is written before the store records the sleep woken: wait for that, so that the next case's
    # sleep is not refused sleep.in_progress.
    for i in range(6000):
        answer = put(a, f"woken{i}", {"type": "status"})
        wait_until(answer.exists, 60)
        sleep = json.loads(answer.read_text()).get("sleep") or {}
        if sleep.get("state") == "woken":
            break
        time.sleep(0.01)
    return row


def case_snapshot(a: Path, b: Path, dirs: int) -> dict[str, object]:
    got: dict[str, object] = {}

    def during() -> None:
        answer = put(a, "snap", {"type": "sleep", "launches": [{"name": "t", "command": "true"}]})
        wait_until(answer.exists, 600)
        got.update(json.loads(answer.read_text()))

    row = measure(f"b: snapshot of {dirs:,} directories", b, during)
    row["a_answer"] = got.get("type")  # accepted, or rejected (snapshot.failed) when the walk ran out of fds
    error = got.get("error")
    if isinstance(error, dict):
        row["a_error"] = f"{error.get('code')}: {error.get('message')}"
    return row


def case_idle(b: Path) -> dict[str, object]:
    return measure("idle: A does nothing (the floor)", b, lambda: time.sleep(10))


def case_temps(a: Path, b: Path, temps: int) -> dict[str, object]:
    rq = a / ".syscall" / "requests"
    names = [rq / f".t{i:06d}.tmp" for i in range(temps)]
    for p in names:
        p.write_bytes(b"{")

    def during() -> None:
        end = time.monotonic() + 10
        i = 0
        while time.monotonic() < end:
            for p in names[i : i + 50]:
                os.utime(p)
            i = (i + 50) % len(names)
            time.sleep(0.02)

    row = measure(f"c: {temps:,} temp names touched every 20 ms", b, during)
    for p in names:
        p.unlink(missing_ok=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="idle,artifacts,snapshot,temps")
    ap.add_argument("--rescan-seconds", type=float, default=5.0)
    ap.add_argument("--dirs", type=int, default=20_000)
    ap.add_argument("--temps", type=int, default=100_000)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    top = Path(tempfile.mkdtemp(prefix="bench-iso-"))
    kernel = Kernel(top, args.rescan_seconds)
    try:
        cases = args.cases.split(",")
        a = workspace(top / "a", args.dirs if "snapshot" in cases else 0)
        b = workspace(top / "b")
        for ws in (a, b):
            kernel.cli("enroll", str(ws), "--launches", "1000", "--sleeps", "1000", "--gpu-hours", "100")
        kernel.start()
        for case in cases:
            if case == "idle":
                row = case_idle(b)
            elif case == "artifacts":
                row = case_artifacts(a, b)
            elif case == "snapshot":
                row = case_snapshot(a, b, args.dirs)
            elif case == "temps":
                row = case_temps(a, b, args.temps)
            else:
                raise SystemExit(f"unknown case {case!r}")
            print(json.dumps(row), flush=True)
    finally:
        kernel.stop()
        if args.keep:
            print(f"kept {top}", file=sys.stderr)
        else:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
