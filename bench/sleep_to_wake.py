"""Sleep -> tasks running, and job end -> wake, on the local backend with a real kernel process.

A git workspace of 1,000 files (4 KiB each, committed, plus one dirty file) is enrolled in a real
`syscall-kernel serve` (local backend, `[local] max_parallel = 8` so the 4 tasks of a sleep can all start).
Each sample commits a sleep of 4 launches (`true`) through `requests/` and measures:

- sleep -> accepted: request renamed -> `answers/<id>.json` present (snapshot of the 1,000 files, run
  directories written, every launch handed to the backend, job ids recorded);
- sleep -> all tasks started: request renamed -> the local backend has spawned all 4 job wrappers (each
  task's `local.pid` holds its pid);
- sleep -> all tasks running: request renamed -> the 4 wrappers' `started` files all present (a wrapper writes
  `started` after its interpreter starts, before it materialises the tree and starts the jail);
- exit file -> wake file: the last task's `exit-code` (its mtime) -> `wakes/<id>.md` (its mtime), the file the
  tool waits for; both timestamps come from the same filesystem clock.

With `--backend slurm` (SLURM_CONF names a running cluster, e.g. `scripts/slurm-cluster start DIR`), the same
sleeps go through `sbatch`: "all tasks started" is then "all jobs submitted" (each launch's `slurm-job.json`, the
id sbatch answered, is written), and "running" includes Slurm's own scheduling delay.

The bench polls for files every 1 ms (4 stats per poll). Prints one JSON object per scenario. Usage:
    .venv/bin/python bench/sleep_to_wake.py [--samples 100] [--files 1000] [--jails bwrap,none] [--keep]
                                            [--backend local|slurm]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernelproc import git  # noqa: E402

from channel.paths import workspace_key  # noqa: E402

LAUNCHES = 4


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def summary(name: str, jail: str, files: int, xs: list[float], backend: str = "local") -> dict[str, object]:
    return {
        "scenario": name,
        "backend": backend,
        "jail": jail,
        "files": files,
        "launches": LAUNCHES,
        "samples": len(xs),
        "p50_ms": round(statistics.median(xs), 2),
        "p90_ms": round(pct(xs, 90), 2),
        "p99_ms": round(pct(xs, 99), 2),
        "max_ms": round(max(xs), 2),
    }


def make_workspace(ws: Path, files: int) -> None:
    ws.mkdir(parents=True)
    git(ws, "init", "-q")
    for i in range(files):
        d = ws / f"pkg{i % 20:02d}"
        d.mkdir(exist_ok=True)
        (d / f"mod{i:04d}.py").write_bytes(os.urandom(2048).hex().encode())
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "a workspace of many files")
    (ws / "pkg00" / "mod0000.py").write_text("# dirty\n")


def spawned(pid_file: Path) -> bool:
    """The local backend records the wrapper's pid right after spawning it (null while only claimed)."""
    try:
        return json.loads(pid_file.read_bytes()).get("pid") is not None
    except (FileNotFoundError, ValueError):
        return False


def wait_until(cond: object, timeout: float) -> float:
    """Poll `cond()` every 1 ms; return time.perf_counter() when it held."""
    deadline = time.perf_counter() + timeout
    while True:
        if cond():  # type: ignore[operator]
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.001)


def submitted(job_file: Path) -> bool:
    """The Slurm backend records the id sbatch answered in the launch's `slurm-job.json`."""
    return job_file.exists()


def run(
    jail: str, samples: int, files: int, keep: bool = False, backend: str = "local"
) -> list[dict[str, object]]:
    top = Path(tempfile.mkdtemp(prefix="bench-s2w-"))
    proc = None
    try:
        ws = top / "ws"
        make_workspace(ws, files)
        state = top / "state"
        config = top / "config.toml"
        config.write_text(
            ("allow_root = true\n" if os.geteuid() == 0 else "")
            + f'state_dir = "{state}"\njail = "{jail}"\nbackend = "{backend}"\n[local]\nmax_parallel = 8\n'
            "[slurm]\npoll_seconds = 1.0\n"
        )
        cli = [sys.executable, "-m", "kernel.cli"]
        enroll = [
            *cli,
            "enroll",
            str(ws),
            "--launches",
            "100000",
            "--sleeps",
            "100000",
            "--config",
            str(config),
        ]
        subprocess.run(enroll, cwd=ROOT, check=True, capture_output=True)
        log = open(top / "kernel.log", "ab")  # noqa: SIM115 - closed below
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        proc = subprocess.Popen(
            [*cli, "serve", "--config", str(config)], cwd=ROOT, stdout=log, stderr=log, env=env
        )
        wait_until(lambda: b"event=ready" in (top / "kernel.log").read_bytes(), 60)
        ch = ws / ".syscall"
        runs = state / "runs" / workspace_key(ws.resolve())
        accepted: list[float] = []
        spawns: list[float] = []
        started: list[float] = []
        woken: list[float] = []
        for i in range(samples + 2):  # the first two warm up
            rid = f"b{i}"
            seq = i + 1
            req = {
                "protocol": 1,
                "id": rid,
                "type": "sleep",
                "launches": [{"name": f"l{k}", "command": "true", "minutes": 5} for k in range(LAUNCHES)],
            }
            tmp = ch / "requests" / f".{rid}.tmp"
            tmp.write_bytes(json.dumps(req).encode())
            starts = [runs / str(seq) / f"l{k}" / "started" for k in range(LAUNCHES)]
            marker = "local.pid" if backend == "local" else "slurm-job.json"
            pids = [runs / str(seq) / f"l{k}" / marker for k in range(LAUNCHES)]
            handed = spawned if backend == "local" else submitted
            t0 = time.perf_counter()
            os.rename(tmp, ch / "requests" / f"{rid}.json")
            answer = ch / "answers" / f"{rid}.json"
            t_acc = t_start = t_spawn = None
            while t_acc is None or t_start is None or t_spawn is None:
                now = time.perf_counter()
                if t_acc is None and answer.exists():
                    t_acc = now
                if t_spawn is None and all(handed(p) for p in pids):
                    t_spawn = now
                if t_start is None and all(p.exists() for p in starts):
                    t_start = now
                if now - t0 > 120:
                    raise TimeoutError(f"sample {i}: no answer or not all tasks started")
                time.sleep(0.001)
            md = ch / "wakes" / f"{rid}.md"
            wait_until(md.exists, 120)
            exits = [runs / str(seq) / f"l{k}" / "exit-code" for k in range(LAUNCHES)]
            last_exit = max(p.stat().st_mtime_ns for p in exits)
            if i >= 2:
                accepted.append((t_acc - t0) * 1000)
                spawns.append((t_spawn - t0) * 1000)
                started.append((t_start - t0) * 1000)
                woken.append((md.stat().st_mtime_ns - last_exit) / 1e6)
        handed_name = (
            "started (wrappers spawned)" if backend == "local" else "submitted (sbatch ids recorded)"
        )
        return [
            summary("sleep -> accepted (snapshot + submit)", jail, files, accepted, backend),
            summary(f"sleep -> all tasks {handed_name}", jail, files, spawns, backend),
            summary("sleep -> all tasks running (wrappers wrote `started`)", jail, files, started, backend),
            summary("exit file -> wake file", jail, files, woken, backend),
        ]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        if keep:
            print(f"kept {top}", file=sys.stderr)
        else:
            shutil.rmtree(top, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--jails", default="bwrap")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (kernel log, run dirs)")
    ap.add_argument("--backend", choices=("local", "slurm"), default="local")
    args = ap.parse_args()
    if args.backend == "slurm" and not Path(os.environ.get("SLURM_CONF", "/nonexistent")).is_file():
        raise SystemExit(
            "--backend slurm needs SLURM_CONF naming a running cluster (scripts/slurm-cluster start)"
        )
    for jail in args.jails.split(","):
        for row in run(jail, args.samples, args.files, args.keep, args.backend):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
