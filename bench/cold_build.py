"""Sleep accepted with a cold build: how long a sleep on a new uv.lock waits for its answer, and for its wake.

A real `syscall-kernel serve` (local backend, bwrap) of the checkout `--root` (this one by default; another one
for a before/after pair) serves one workspace committing `pyproject.toml` + `uv.lock` of `--deps` (default
numpy, scikit-learn, matplotlib, locked here with uv against PyPI). Each sample locks a new project version (a
new cache key: uv downloads and unpacks every wheel again), stages one launch importing the packages, and runs
the installed tool's `sleep` (commit -> answer: the tool writes the request and waits for the answer file) then
`wait` (-> the wake). With a kernel that builds in the background the answer comes before the build; with one
that builds first it comes after (and past the tool's 60 s answer wait, not at all). Prints one JSON object.

    .venv/bin/python bench/cold_build.py [--samples 3] [--root /path/to/other/checkout] [--deps a,b,c]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernelproc import Kernel, git, lock, tool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose kernel runs")
    ap.add_argument("--deps", default="numpy,scikit-learn,matplotlib")
    ap.add_argument("--imports", default="numpy,sklearn,matplotlib")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    deps = args.deps.split(",")
    command = 'python -c "import ' + ", ".join(args.imports.split(",")) + '"'
    tmp = Path(tempfile.mkdtemp(prefix="syscall-bench-coldbuild-"))
    state = tmp / "state"
    config = tmp / "config.toml"
    allow_root = "allow_root = true\n" if os.geteuid() == 0 else ""
    config.write_text(f'state_dir = "{state}"\n{allow_root}jail = "bwrap"\n')
    ws = tmp / "ws"
    ws.mkdir()
    git(ws, "init", "-q")
    (ws / "README").write_text("bench\n")
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "init")
    subprocess.run(
        [sys.executable, "-m", "kernel.cli", "enroll", "--config", str(config), str(ws), "--sleeps", "50"],
        cwd=args.root,
        check=True,
        capture_output=True,
    )
    kernel = Kernel(config, tmp / "kernel.log", root=args.root)
    kernel.start_ready()
    rows = []
    try:
        for i in range(args.samples):
            lock(ws, deps, i)
            tool(ws, "launch", "--name", "imp", "--minutes", "30", "--", command)
            t0 = time.monotonic()
            done = tool(ws, "sleep", "--json", "--timeout", "1800", timeout=1800, check=False)
            answered = time.monotonic() - t0
            ans = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
            if ans.get("type") != "accepted":
                raise SystemExit(f"sample {i}: {done.stdout}{done.stderr}")
            wake = json.loads(tool(ws, "wait", "--json", "--timeout", "1800", timeout=1800).stdout)
            woken = time.monotonic() - t0
            [t] = wake["tasks"]
            if t["state"] != "COMPLETED":
                raise SystemExit(f"sample {i}: the task did not complete: {t}")
            rows.append((answered, woken, ans.get("building") is not None))
            print(
                json.dumps({"sample": i, "answer_s": round(answered, 3), "wake_s": round(woken, 3)}),
                file=sys.stderr,
            )
    finally:
        kernel.stop()
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    answers = [r[0] for r in rows]
    wakes = [r[1] for r in rows]
    print(
        json.dumps(
            {
                "root": str(args.root),
                "deps": deps,
                "samples": len(rows),
                "answered_building": sum(r[2] for r in rows),
                "commit_to_answer_p50_s": round(statistics.median(answers), 3),
                "commit_to_answer_max_s": round(max(answers), 3),
                "commit_to_wake_p50_s": round(statistics.median(wakes), 3),
                "commit_to_wake_max_s": round(max(wakes), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
