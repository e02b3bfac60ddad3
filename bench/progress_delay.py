"""Progress delay: a task's end -> the line the tool's `wait` prints for it, with a real kernel (local backend).

Each sample stages two launches, `fast` (`sleep 0.5`) and `slow` (`sleep 2.5`, or `--slow`), commits them with `sleep` and
runs `wait` (the installed tool, `--every` as given, default 0.2 s), timestamping each line as it arrives. Per
sample:

- exit-code -> progress file: `fast`'s `exit-code` in its run directory (its mtime) -> the first
  `results/<seq>/progress.json` that shows it ended (the kernel's part: backend exit event, store record, the
  write in the heavy pool), seen by a 1 ms poll of the file;
- exit-code -> line: the same `exit-code` -> the arrival of `wait`'s `fast[0] COMPLETED` line (the kernel's part
  plus the tool's look interval and its stdout);
- status requests: how many `status` answers the kernel gave while the tool waited (0: the tool followed the
  progress file only).

Before the progress file, `wait` asked `status` every 10 s, so the line came up to 10 s after the end (issue 25:
an end at +1.5 s was printed at +10.6 s); run this script from such a checkout with `--slow 12` to see it (the
progress-file figure is then null: no file is written). Prints one JSON object. Usage:
    .venv/bin/python bench/progress_delay.py [--samples 20] [--every 0.2] [--jail none|bwrap] [--slow 2.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kernelproc import Kernel, make_workspace, run_tool, wait_for  # noqa: E402


def ms(xs: list[float]) -> dict[str, float]:
    s = sorted(x * 1000 for x in xs)
    return {
        "p50_ms": round(statistics.median(s), 1),
        "p90_ms": round(s[int(0.9 * (len(s) - 1))], 1),
        "max_ms": round(s[-1], 1),
    }


def one(kernel: Kernel, ws: Path, every: float, slow: str) -> tuple[float | None, float, int]:
    kernel.wait_log("event=woken", 30, count=kernel.log_text().count("event=sleep_recorded"))
    for name, secs in (("fast", "0.5"), ("slow", slow)):
        done = run_tool(ws, "launch", "--name", name, "--minutes", "5", "--", "sleep", secs, timeout=30)
        assert done.returncode == 0, done.stderr
    done = run_tool(ws, "sleep", "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    seq = answer["sleep_seq"]
    asked = kernel.log_text().count("outcome=status")
    progress = ws / ".syscall" / "results" / str(seq) / "progress.json"
    file_seen: list[float] = []
    waited = threading.Event()

    def watch() -> None:  # the first progress file that shows `fast` ended
        while not file_seen and not waited.is_set():
            try:
                doc = json.loads(progress.read_bytes())
            except (OSError, ValueError):
                doc = {}
            if any(t["launch"] == "fast" and t["state"] == "COMPLETED" for t in doc.get("tasks", [])):
                file_seen.append(time.time())
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    line_at = None
    proc = subprocess.Popen(
        [sys.executable, str(ws / ".syscall" / "syscall"), "wait", "--every", str(every)],
        cwd=ws,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line_at is None and "fast[0] COMPLETED" in line:
            line_at = time.time()
    assert proc.wait(60) == 0
    waited.set()
    watcher.join(10)
    assert line_at is not None
    (exit_code,) = wait_for(lambda: sorted(kernel.dir.rglob(f"{seq}/fast/exit-code")), 10, "exit-code")
    ended = os.stat(exit_code).st_mtime
    to_file = file_seen[0] - ended if file_seen else None
    return to_file, line_at - ended, kernel.log_text().count("outcome=status") - asked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--every", type=float, default=0.2, help="the tool's `wait --every`")
    ap.add_argument("--jail", default="none", choices=("none", "bwrap"))
    ap.add_argument("--slow", default="2.5", help="seconds the second task sleeps")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kernel = Kernel(Path(tmp), f'jail = "{args.jail}"\n')
        ws = make_workspace(Path(tmp) / "ws")
        kernel.enroll(ws, "--launches", str(2 * args.samples + 2), "--sleeps", str(args.samples + 1))
        kernel.start()
        try:
            to_file: list[float] = []
            to_line: list[float] = []
            asked = 0
            for _ in range(args.samples):
                f, line, n = one(kernel, ws, args.every, args.slow)
                if f is not None:
                    to_file.append(f)
                to_line.append(line)
                asked += n
        finally:
            kernel.stop()
    print(
        json.dumps(
            {
                "scenario": "task end -> wait's line",
                "jail": args.jail,
                "every_s": args.every,
                "samples": args.samples,
                "slow_s": float(args.slow),
                "exit_code_to_progress_file": ms(to_file) if to_file else None,
                "exit_code_to_line": ms(to_line),
                "status_requests": asked,
            }
        )
    )


if __name__ == "__main__":
    main()
