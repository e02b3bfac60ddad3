"""Start-up: first-time enrollment of N workspaces from a glob, then restart-to-ready with N enrolled.

N real git workspaces (one commit each, so every enrollment has a submit base to record) under one directory;
a real kernel process (`syscall-kernel serve`) whose `workspaces` glob matches them all. Measured:
  first_ready_s    process start -> `event=ready` on the first start (every workspace enrolled)
  enrolled         `event=enrolled` lines of the first start (must be N: each enrolled exactly once)
  bases_held_s     process start -> every pending base imported into the kernel's repository (after ready;
                   until `event=bases_checked`), or null when --no-bases
  restart_ready_s  process start -> `event=ready` on a second start with N enrolled (nothing new)
  *_starting_to_ready_s  the same from the kernel's `event=starting` line (without the interpreter's start-up
                   and imports), read from the log's timestamps
  refreshed_s      restart's process start -> `event=channels_refreshed` (the kernel files checked, after ready)
  restart2_ready_s a third start: each owner accepted from one lstat matching the kernel.json fingerprint the
                   second start recorded (the second read every kernel.json: the first start had just written them)
The kernel runs with bytecode caching allowed (as an installed kernel has its .pyc files; the caches are warmed
first), whatever PYTHONDONTWRITEBYTECODE says here. The workspaces are synced to disk before the first start.
Prints one JSON object per N. Usage:
    .venv/bin/python bench/startup.py [--workspaces 1000] [--keep DIR] [--no-bases]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspaces", type=int, default=1000)
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    ap.add_argument("--no-bases", action="store_true", help="do not wait for the background base imports")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-startup-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        n = args.workspaces
        spaces = root / f"n{n}" / "agents"
        make_workspaces(spaces, n)
        os.sync()
        warm_imports()
        k = Kernel(
            write_config(root / f"n{n}" / "config.toml", root / f"n{n}" / "state", spaces),
            root / f"n{n}" / "kernel.log",
        )
        first = k.start_ready()
        enrolled = k.count(b"event=enrolled")
        bases = None
        if not args.no_bases:
            t0 = time.perf_counter() - first
            k.wait(b"event=bases_checked", 1, every=0.1)
            bases = round(time.perf_counter() - t0, 2)
        held = k.count(b"event=submit_base_held")
        k.stop()
        done = k.count(b"event=channels_refreshed")  # the first start's
        again = k.start_ready()
        t0 = time.perf_counter() - again
        k.wait(b"event=channels_refreshed", done + 1, every=0.05)
        refreshed = round(time.perf_counter() - t0, 2)
        k.stop()
        # The restart above read every kernel.json in full (the first start wrote them moments before) and
        # recorded their fingerprints; this one checks each owner with one lstat.
        time.sleep(1.1)
        third = k.start_ready()
        k.stop()
        print(
            json.dumps(
                {
                    "workspaces": n,
                    "first_ready_s": round(first, 2),
                    "enrolled": enrolled,
                    "bases_held_s": bases,
                    "bases_held": held,
                    "first_starting_to_ready_s": k.starting_to_ready(0),
                    "restart_ready_s": round(again, 2),
                    "restart_starting_to_ready_s": k.starting_to_ready(1),
                    "refreshed_s": refreshed,
                    "restart2_ready_s": round(third, 2),
                    "restart2_starting_to_ready_s": k.starting_to_ready(2),
                    "enrolled_again": k.count(b"event=enrolled") - enrolled,
                    "cores": os.cpu_count(),
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }
            ),
            flush=True,
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
