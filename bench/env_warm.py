"""Locked environments: what a uv.lock costs a sleep, cold cache vs warm cache vs no environment.

A real `syscall-kernel serve` (local backend, bwrap, `[local] max_parallel = 4`) serves two workspaces: one with
`pyproject.toml` + `uv.lock` of ~10 packages (requests, jinja2, click, attrs, packaging, six and their
dependencies; locked here with uv against PyPI), one without. Each sample stages LAUNCHES launches and runs `sleep` through
the installed tool: `python -c pass` in both workspaces (what the environment adds to a job), and, for
information, `python -c "import ..."` of the 6 packages (cold: a new lockfile each sample). It measures

- sleep -> accepted: the tool's `sleep` (cold: includes the kernel's warm-up, i.e. uv downloading every wheel);
- per job: the task's elapsed time in the wake (`started` -> `ended` by the wrapper: materialising the tree,
  building the private venv from the cache for the env workspace, the jail, the command);
- sleep -> wake: the whole `sleep` + `wait`.

Cold samples change the project's version in pyproject.toml and re-lock, so each is a new cache key (a full
download). Prints one JSON object per scenario. Usage:
    .venv/bin/python bench/env_warm.py [--samples 10] [--cold 3] [--keep] [--deps numpy,scikit-learn
                                       --imports numpy,sklearn]
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

from kernelproc import git, lock, tool  # noqa: E402

LAUNCHES = 4
DEPS = ["requests", "jinja2", "click", "attrs", "packaging", "six"]
IMPORTS = "import requests, jinja2, click, attrs, packaging, six"


def one_sleep(ws: Path, command: str) -> tuple[float, list[float], float]:
    for i in range(LAUNCHES):
        tool(ws, "launch", "--name", f"j{i}", "--minutes", "5", "--", command)
    t0 = time.monotonic()
    tool(ws, "sleep")
    accepted = time.monotonic() - t0
    wake = json.loads(tool(ws, "wait", "--json", "--timeout", "600").stdout)
    total = time.monotonic() - t0
    tasks = wake["tasks"]
    bad = [t for t in tasks if t["state"] != "COMPLETED"]
    if bad:
        raise SystemExit(f"a task did not complete: {bad[0]}")
    return accepted, [float(t["elapsed_s"]) for t in tasks], total


def summary(name: str, rows: list[tuple[float, list[float], float]]) -> dict[str, object]:
    acc = [r[0] * 1000 for r in rows]
    per_job = [e for r in rows for e in r[1]]
    tot = [r[2] for r in rows]
    return {
        "scenario": name,
        "samples": len(rows),
        "launches": LAUNCHES,
        "sleep_to_accepted_p50_ms": round(statistics.median(acc), 1),
        "sleep_to_accepted_max_ms": round(max(acc), 1),
        "job_elapsed_p50_s": round(statistics.median(per_job), 3),
        "job_elapsed_max_s": round(max(per_job), 3),
        "sleep_to_wake_p50_s": round(statistics.median(tot), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--cold", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--deps", help="comma-separated packages to lock instead (e.g. numpy,scikit-learn)")
    ap.add_argument("--imports", help="comma-separated modules the import jobs import (with --deps)")
    args = ap.parse_args()
    global DEPS, IMPORTS
    if args.deps:
        DEPS = args.deps.split(",")
        IMPORTS = "import " + ", ".join((args.imports or args.deps).split(","))
    tmp = Path(tempfile.mkdtemp(prefix="syscall-bench-env-"))
    state = tmp / "state"
    config = tmp / "config.toml"
    allow_root = "allow_root = true\n" if os.geteuid() == 0 else ""
    config.write_text(
        f'state_dir = "{state}"\n{allow_root}jail = "bwrap"\n[local]\nmax_parallel = {LAUNCHES}\n'
    )
    env_ws, plain_ws = tmp / "env", tmp / "plain"
    for ws in (env_ws, plain_ws):
        ws.mkdir()
        git(ws, "init", "-q")
        (ws / "README").write_text("bench\n")
        git(ws, "add", "-A")
        git(ws, "commit", "-q", "-m", "init")
    lock(env_ws, DEPS, 0, ">=3.8")
    exe = str(ROOT / ".venv" / "bin" / "syscall-kernel")
    total = args.samples * 2 + args.cold + 2
    for ws in (env_ws, plain_ws):
        subprocess.run(
            [
                exe,
                "enroll",
                "--config",
                str(config),
                str(ws),
                "--sleeps",
                str(total),
                "--launches",
                str(total * LAUNCHES),
            ],
            check=True,
            capture_output=True,
        )
    log = open(tmp / "kernel.log", "wb")  # noqa: SIM115 (open for the kernel's lifetime)
    proc = subprocess.Popen([exe, "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(2)
        cold = []
        for i in range(args.cold):
            if i:
                lock(env_ws, DEPS, i, ">=3.8")
            cold.append(one_sleep(env_ws, f'python -c "{IMPORTS}"'))
        one_sleep(plain_ws, "python3 -c pass")  # warm the page cache for the plain runs too
        warm = [one_sleep(env_ws, "python -c pass") for _ in range(args.samples)]
        plain = [one_sleep(plain_ws, "python3 -c pass") for _ in range(args.samples)]
        imports = [one_sleep(env_ws, f'python -c "{IMPORTS}"') for _ in range(args.samples)]
        packages = len(json.loads((env_ws / ".syscall" / "jobenv.json").read_text())["locked"]["packages"])
        scenarios = (
            ("cold cache, job imports the 6 packages", cold),
            ("warm cache, job: python -c pass", warm),
            ("no environment, job: python3 -c pass", plain),
            ("warm cache, job imports the 6 packages", imports),
        )
        for name, rows in scenarios:
            out = summary(name, rows)
            out["packages"] = 0 if name.startswith("no environment") else packages
            print(json.dumps(out))
        added = statistics.median([e for r in warm for e in r[1]]) - statistics.median(
            [e for r in plain for e in r[1]]
        )
        print(json.dumps({"warm_adds_per_job_s": round(added, 3), "target_s": 1.0}))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    main()
