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
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernelproc import Kernel, make_workspaces, warm_imports, write_config


def term(k: Kernel, scenario: str, n: int) -> None:
    forced = k.count(b"event=stop_forced")
    rc, took = k.stop()
    print(
        json.dumps(
            {
                "scenario": scenario,
                "workspaces": n,
                "took_s": round(took, 3),
                "rc": rc,
                "forced": k.count(b"event=stop_forced") > forced,
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
        spaces = root / "agents"
        make_workspaces(spaces, n)
        os.sync()
        warm_imports()
        k = Kernel(
            write_config(root / "config.toml", root / "state", spaces, 'jail = "none"\n'), root / "kernel.log"
        )
        k.start()
        k.wait(b"event=enrolled", 1, 1800, every=0.01)
        term(k, "enrolling", n)
        k.start_ready()  # the rest is enrolled now
        term(k, "idle", n)
        for _ in range(args.repeat):
            starts = k.count(b"event=starting")
            k.start()
            k.wait(b"event=starting", starts + 1, 1800, every=0.01)
            time.sleep(0.05)
            term(k, "starting", n)
        for _ in range(args.repeat):
            k.start_ready()
            term(k, "idle", n)
        for i in range(args.repeat):
            ws = spaces / f"ws{i:05d}"  # a workspace of its own each time: the last one's sleep is resumed
            for j in range(3):
                with open(ws / f"data{j}.bin", "wb") as f:
                    f.truncate(250 * 1024 * 1024)
            recorded = k.count(b"event=sleep_recorded")
            k.start_ready()
            body = {
                "protocol": 1,
                "id": f"s{i}",
                "type": "sleep",
                "launches": [{"name": "quick", "command": "true", "minutes": 1}],
            }
            req = ws / ".syscall" / "requests"
            (req / f".s{i}.tmp").write_text(json.dumps(body))
            os.rename(req / f".s{i}.tmp", req / f"s{i}.json")
            k.wait(b"event=sleep_recorded", recorded + 1, 1800, every=0.01)
            time.sleep(0.5)
            term(k, "snapshot", n)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
