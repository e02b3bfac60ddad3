"""Per-task overhead with a warm locked environment: task start -> the command's first instruction, and the
command's exit -> `exit-code` -> the slot free for the next task (local backend, a real kernel process).

A real `syscall-kernel serve` (local backend, `[local] max_parallel = 1`) serves two git workspaces: one
committing `pyproject.toml` + `uv.lock` (`--deps`, locked here with uv against PyPI), one without. A first sleep
warms the environment (uv downloads and installs it once); then each sample is one sleep of one launch
`--array TASKS --concurrency 1`, so its tasks run one after another, each running `date +%s%N` (its first and
last instruction, printed to its stdout) and `command -v python` (which interpreter PATH gives it). Per task:

- spawn -> first instruction: the local backend's `local.pid` (written just after it spawned the wrapper: its
  mtime) -> the nanoseconds `date` printed (the wrapper's interpreter start, its `started` stamp, the tree's
  materialisation, the environment - a private venv synced per task before, the shared one bound now - the jail);
- started -> first instruction: the wrapper's own `started` stamp -> the same;
- exit -> exit-code: what `date` printed -> `exit-code`'s mtime (the jail's end, `ended`, artifacts, scratch
  removal where it comes before the record);
- exit-code -> next spawn: `exit-code` -> the next task's `local.pid` (the wrapper's exit, the kernel's notice,
  the slot given to the next task);
- the task's `elapsed_s` in the wake and the whole sleep (commit -> wake) for the TASKS serial tasks.

File mtimes come from the filesystem's coarse clock (a tick, 1-4 ms, behind the real one); `date` reads the real
one. `--kernel-root` runs another checkout's kernel (the "before" figure). Prints one JSON object per scenario.
Usage:
    .venv/bin/python bench/task_overhead.py [--tasks 8] [--samples 3] [--deps numpy,scikit-learn]
                                            [--jails bwrap,none] [--files 0] [--kernel-root CHECKOUT]
                                            [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernelproc import Kernel, git, kernel_env, lock, tool  # noqa: E402
from sleep_to_wake import pct  # noqa: E402

from channel.paths import workspace_key  # noqa: E402
from kernel.io.envcache import remove_entry  # noqa: E402

PYTHON = "/usr/bin/python3"
COMMAND = "date +%s%N; command -v python || echo none"


def make_workspace(ws: Path, deps: list[str] | None, files: int) -> None:
    ws.mkdir(parents=True)
    git(ws, "init", "-q")
    (ws / "README").write_text("bench\n")
    for i in range(files):  # each task's tree: materialised before the command, removed after it
        d = ws / "data" / f"{i // 100:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}.txt").write_bytes(bytes([65 + i % 26]) * 4096)
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "init")
    if deps is not None:
        lock(ws, deps, 1, ">=3.8")


def mtime(path: Path) -> float:
    return path.stat().st_mtime_ns / 1e9


def one_sleep(ws: Path, run_dir: Path, tasks: int, name: str) -> tuple[list[dict[str, float]], float, str]:
    """One sleep of TASKS serial tasks; (per-task figures, commit -> wake seconds, what `command -v python`
    printed)."""
    tool(
        ws,
        "launch",
        "--name",
        name,
        "--minutes",
        "5",
        "--array",
        str(tasks),
        "--concurrency",
        "1",
        "--",
        COMMAND,
    )
    t0 = time.monotonic()
    wake = json.loads(tool(ws, "sleep", "--wait", "--json", "--timeout", "1200", timeout=1500).stdout)
    total = time.monotonic() - t0
    bad = [t for t in wake["tasks"] if t["state"] != "COMPLETED"]
    if bad:
        raise SystemExit(f"a task did not complete: {bad[0]}")
    seq_dir = max((run_dir / workspace_key(ws.resolve())).iterdir(), key=lambda p: int(p.name))
    tdirs = sorted(seq_dir.rglob("local.pid"), key=mtime)
    if len(tdirs) != tasks:
        raise SystemExit(f"expected {tasks} task directories under {seq_dir}, found {len(tdirs)}")
    rows: list[dict[str, float]] = []
    python = ""
    for i, pid_file in enumerate(tdirs):
        tdir = pid_file.parent
        lines = (tdir / "stdout").read_text().split()
        first = int(lines[0]) / 1e9
        python = lines[1]
        started = datetime_of((tdir / "started").read_text().strip())
        exit_code = mtime(tdir / "exit-code")
        row = {
            "spawn_to_first_ms": (first - mtime(pid_file)) * 1000,
            "started_to_first_ms": (first - started) * 1000,
            "exit_to_exit_code_ms": (exit_code - first) * 1000,
        }
        if i + 1 < len(tdirs):
            row["exit_code_to_next_spawn_ms"] = (mtime(tdirs[i + 1]) - exit_code) * 1000
        rows.append(row)
    elapsed = {t["task"]: float(t["elapsed_s"]) for t in wake["tasks"] if "elapsed_s" in t}
    for row, e in zip(rows, elapsed.values(), strict=False):
        row["elapsed_s"] = e
    return rows, total, python


def datetime_of(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def summary(
    scenario: str, jail: str, rows: list[dict[str, float]], totals: list[float], tasks: int, python: str
) -> dict[str, object]:
    out: dict[str, object] = {"scenario": scenario, "jail": jail, "tasks": len(rows), "python": python}
    for key in (
        "spawn_to_first_ms",
        "started_to_first_ms",
        "exit_to_exit_code_ms",
        "exit_code_to_next_spawn_ms",
        "elapsed_s",
    ):
        xs = [r[key] for r in rows if key in r]
        if xs:
            digits = 3 if key == "elapsed_s" else 1
            out[key.removesuffix("_ms").removesuffix("_s") + ("_s" if key == "elapsed_s" else "_ms")] = {
                "p50": round(statistics.median(xs), digits),
                "p90": round(pct(xs, 90), digits),
                "max": round(max(xs), digits),
            }
    out[f"sleep_of_{tasks}_serial_tasks_s_p50"] = round(statistics.median(totals), 2)
    return out


def run_jail(args: argparse.Namespace, jail: str, tmp: Path) -> list[dict[str, object]]:
    state = tmp / jail / "state"
    config = tmp / jail / "config.toml"
    config.parent.mkdir(parents=True)
    allow_root = "allow_root = true\n" if os.geteuid() == 0 else ""
    config.write_text(
        f'state_dir = "{state}"\n{allow_root}jail = "{jail}"\n[environment]\npython = "{PYTHON}"\n'
        "[local]\nmax_parallel = 1\n"
    )
    env_ws, plain_ws = tmp / jail / "env", tmp / jail / "plain"
    make_workspace(env_ws, args.deps.split(","), args.files)
    make_workspace(plain_ws, None, args.files)
    sleeps = args.samples + 2
    for ws in (env_ws, plain_ws):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kernel.cli",
                "enroll",
                "--config",
                str(config),
                str(ws),
                "--sleeps",
                str(sleeps),
                "--launches",
                str(sleeps),
            ],
            cwd=args.kernel_root,
            env=kernel_env(),
            check=True,
            capture_output=True,
        )
    kernel = Kernel(config, tmp / jail / "kernel.log", root=Path(args.kernel_root))
    kernel.start_ready()
    run_dir = state / "runs"
    out = []
    try:
        t0 = time.monotonic()
        one_sleep(env_ws, run_dir, 1, "warm")  # builds the environment: not counted
        warm_s = time.monotonic() - t0
        one_sleep(plain_ws, run_dir, 1, "warm")
        for ws, scenario in ((env_ws, "warm locked environment"), (plain_ws, "no environment")):
            rows: list[dict[str, float]] = []
            totals = []
            python = ""
            for i in range(args.samples):
                got, total, python = one_sleep(ws, run_dir, args.tasks, f"s{i}")
                rows += got
                totals.append(total)
            s = summary(scenario, jail, rows, totals, args.tasks, python)
            s["files"] = args.files
            if ws is env_ws:
                s["first_sleep_with_build_s"] = round(warm_s, 1)
                s["deps"] = args.deps
            out.append(s)
    finally:
        kernel.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=8, help="serial tasks per sleep (at most 16)")
    ap.add_argument("--samples", type=int, default=3, help="sleeps per scenario")
    ap.add_argument("--deps", default="numpy,scikit-learn", help="comma-separated packages to lock")
    ap.add_argument("--jails", default="bwrap,none")
    ap.add_argument("--files", type=int, default=0, help="4 KiB files committed in each workspace (its tree)")
    ap.add_argument("--kernel-root", default=str(ROOT), help="the checkout whose kernel runs (before/after)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="syscall-bench-overhead-", dir=os.environ.get("BENCH_TMP")))
    try:
        for jail in args.jails.split(","):
            for line in run_jail(args, jail, tmp):
                print(json.dumps(line), flush=True)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            remove_entry(tmp)  # the environments are read-only (envcache.make_read_only)


if __name__ == "__main__":
    main()
