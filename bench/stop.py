"""SIGTERM -> process gone, at several points of a real kernel's life (`syscall-kernel serve`, local backend,
jail none). Scenarios:
  enrolling   first start with N new workspaces from a glob; SIGTERM at the first `event=enrolled`
  starting    restart with N enrolled; SIGTERM 50 ms after `event=starting` (admitting the channels)
  idle        serving N workspaces, nothing in flight
  snapshot    serving, a sleep's snapshot of 750 MB (three sparse 250 MB files) in flight
Each prints one JSON object: seconds from the signal to the exit (`took_s`), the exit status, and whether the
kernel had to abandon work (`event=stop_forced`). Usage:
    .venv/bin/python bench/stop.py [--workspaces 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import ROOT, count, kernel_env, make_workspaces


def launch(root: Path, spaces: Path, log: Path) -> subprocess.Popen[bytes]:
    cfg = root / "config.toml"
    cfg.write_text(
        f'state_dir = "{root / "state"}"\nworkspaces = ["{spaces}/*"]\njail = "none"\n'
        + ("allow_root = true\n" if os.geteuid() == 0 else "")
    )
    out = open(log, "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        [sys.executable, "-m", "kernel.cli", "serve", "--config", str(cfg)],
        cwd=ROOT,
        stdout=out,
        stderr=out,
        env=kernel_env(),
    )


def wait(log: Path, needle: bytes, n: int, proc: subprocess.Popen[bytes], limit: float = 1800) -> None:
    deadline = time.monotonic() + limit
    while count(log, needle) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"waiting for {needle!r}: the kernel exited or took too long; see {log}")
        time.sleep(0.01)


def term(proc: subprocess.Popen[bytes], log: Path, scenario: str, n: int) -> None:
    forced = count(log, b"event=stop_forced")
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(120)
    took = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "scenario": scenario,
                "workspaces": n,
                "took_s": round(took, 3),
                "rc": rc,
                "forced": count(log, b"event=stop_forced") > forced,
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspaces", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.workspaces
    root = Path(tempfile.mkdtemp(prefix="bench-stop-"))
    try:
        spaces = make_workspaces(root, n)
        os.sync()
        subprocess.run(
            [sys.executable, "-c", "import kernel.cli, kernel.service.factory"], cwd=ROOT, env=kernel_env()
        )
        log = root / "kernel.log"
        proc = launch(root, spaces, log)
        wait(log, b"event=enrolled", 1, proc)
        term(proc, log, "enrolling", n)
        proc = launch(root, spaces, log)  # the rest is enrolled now
        wait(log, b"event=ready", 1, proc)
        term(proc, log, "idle", n)
        for _ in range(args.repeat):
            starts = count(log, b"event=starting")
            proc = launch(root, spaces, log)
            wait(log, b"event=starting", starts + 1, proc)
            time.sleep(0.05)
            term(proc, log, "starting", n)
        for _ in range(args.repeat):
            ready = count(log, b"event=ready")
            proc = launch(root, spaces, log)
            wait(log, b"event=ready", ready + 1, proc)
            term(proc, log, "idle", n)
        for i in range(args.repeat):
            ws = spaces / f"ws{i:05d}"  # a workspace of its own each time: the last one's sleep is resumed
            for k in range(3):
                with open(ws / f"data{k}.bin", "wb") as f:
                    f.truncate(250 * 1024 * 1024)
            ready, recorded = count(log, b"event=ready"), count(log, b"event=sleep_recorded")
            proc = launch(root, spaces, log)
            wait(log, b"event=ready", ready + 1, proc)
            body = {
                "protocol": 1,
                "id": f"s{i}",
                "type": "sleep",
                "launches": [{"name": "quick", "command": "true", "minutes": 1}],
            }
            req = ws / ".syscall" / "requests"
            (req / f".s{i}.tmp").write_text(json.dumps(body))
            os.rename(req / f".s{i}.tmp", req / f"s{i}.json")
            wait(log, b"event=sleep_recorded", recorded + 1, proc)
            time.sleep(0.5)
            term(proc, log, "snapshot", n)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
