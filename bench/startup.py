"""Start-up: first-time enrollment of N workspaces from a glob, then restart-to-ready with N enrolled.

N real git workspaces (one commit each, so every enrollment has a submit base to record) under one directory;
a real kernel process (`syscall-kernel serve`) whose `workspaces` glob matches them all. Measured:
  first_ready_s    process start -> `event=ready` on the first start (every workspace enrolled)
  enrolled         `event=enrolled` lines of the first start (must be N: each enrolled exactly once)
  bases_held_s     process start -> every pending base imported into the kernel's repository (after ready;
                   `submit_base_held` N times), or null when --no-bases
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
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_workspaces(root: Path, n: int) -> Path:
    template = root / "template"
    template.mkdir(parents=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b"}
    env["GIT_COMMITTER_EMAIL"] = "b@b"
    subprocess.run(["git", "init", "-q", str(template)], check=True)
    (template / "train.py").write_text("print('hello')\n")
    subprocess.run(["git", "-C", str(template), "add", "train.py"], check=True)
    subprocess.run(["git", "-C", str(template), "commit", "-qm", "start"], check=True, env=env)
    spaces = root / "agents"
    for i in range(n):
        ws = spaces / f"ws{i:05d}"
        ws.mkdir(parents=True)
        shutil.copytree(template / ".git", ws / ".git")
        shutil.copy2(template / "train.py", ws / "train.py")
    return spaces


def count(log: Path, needle: bytes) -> int:
    return log.read_bytes().count(needle)


def stamp(line: bytes) -> float:
    return datetime.fromisoformat(line.split()[0].decode()).timestamp()


def starting_to_ready(log: Path, nth: int) -> float:
    """Seconds from the nth (0-based) `event=starting` line to the `event=ready` after it."""
    lines = log.read_bytes().splitlines()
    starts = [i for i, line in enumerate(lines) if b"event=starting" in line]
    i = starts[nth]
    ready = next(line for line in lines[i:] if b"event=ready" in line)
    return round(stamp(ready) - stamp(lines[i]), 2)


def kernel_env() -> dict[str, str]:
    drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "PYTHONDONTWRITEBYTECODE")
    return {k: v for k, v in os.environ.items() if k not in drop}


def start(root: Path, spaces: Path, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    cfg = root / "config.toml"
    cfg.write_text(
        f'state_dir = "{root / "state"}"\nworkspaces = ["{spaces}/*"]\n'
        + ("allow_root = true\n" if os.geteuid() == 0 else "")
    )
    before = count(log, b"event=ready") if log.exists() else 0
    out = open(log, "ab")  # noqa: SIM115 - lives as long as the process
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernel.cli", "serve", "--config", str(cfg)],
        cwd=ROOT,
        stdout=out,
        stderr=out,
        env=kernel_env(),
    )
    deadline = time.monotonic() + 3600
    while count(log, b"event=ready") <= before:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the kernel did not become ready; see {log}")
        time.sleep(0.02)
    return proc, time.perf_counter() - t0


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


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
        spaces = make_workspaces(root / f"n{n}", n)
        os.sync()
        subprocess.run(
            [sys.executable, "-c", "import kernel.cli, kernel.service.factory"], cwd=ROOT, env=kernel_env()
        )
        log = root / f"n{n}" / "kernel.log"
        proc, first = start(root / f"n{n}", spaces, log)
        enrolled = count(log, b"event=enrolled")
        bases = None
        if not args.no_bases:
            t0 = time.perf_counter() - first
            while count(log, b"event=submit_base_held") + count(log, b"event=submit_base_unheld") < n:
                if proc.poll() is not None:
                    raise SystemExit(f"the kernel exited; see {log}")
                time.sleep(0.1)
            bases = round(time.perf_counter() - t0, 2)
        held = count(log, b"event=submit_base_held")
        stop(proc)
        done = count(log, b"event=channels_refreshed")  # the first start's
        proc, again = start(root / f"n{n}", spaces, log)
        t0 = time.perf_counter() - again
        while count(log, b"event=channels_refreshed") <= done:
            if proc.poll() is not None:
                raise SystemExit(f"the kernel exited; see {log}")
            time.sleep(0.05)
        refreshed = round(time.perf_counter() - t0, 2)
        stop(proc)
        # The restart above read every kernel.json in full (the first start wrote them moments before) and
        # recorded their fingerprints; this one checks each owner with one lstat.
        time.sleep(1.1)
        proc, third = start(root / f"n{n}", spaces, log)
        stop(proc)
        print(
            json.dumps(
                {
                    "workspaces": n,
                    "first_ready_s": round(first, 2),
                    "enrolled": enrolled,
                    "bases_held_s": bases,
                    "bases_held": held,
                    "first_starting_to_ready_s": starting_to_ready(log, 0),
                    "restart_ready_s": round(again, 2),
                    "restart_starting_to_ready_s": starting_to_ready(log, 1),
                    "refreshed_s": refreshed,
                    "restart2_ready_s": round(third, 2),
                    "restart2_starting_to_ready_s": starting_to_ready(log, 2),
                    "enrolled_again": count(log, b"event=enrolled") - enrolled,
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
