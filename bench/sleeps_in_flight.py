"""A research loop's throughput with one sleep at a time against several in flight, on a real kernel.

A real `syscall-kernel serve` (local backend, `[local] max_parallel = 8`) serves one enrolled git workspace. The
bench plays an agent that has `--experiments` experiments to run, each a sleep of one launch that takes
`--task-s` seconds (`sleep`), and commits each next sleep the instant it may:

- `in flight 1`: the workspace's `max_sleeps_in_flight = 1`; the agent commits a sleep, waits for its wake
  (`wakes/<id>.md`), commits the next the moment that file appears (as an agent or MCP harness that acts on a
  wake at once does);
- `in flight N`: `max_sleeps_in_flight = N`; the agent keeps N sleeps in flight, committing the next the moment
  any wake appears.

For each it reports the wall time from the first commit to the last wake, experiments per minute, and how many
sleeps the kernel refused (`sleep.in_progress`: what a wake the agent could already read still counted in
flight gave; it must be 0), each refusal retried at once. Usage:
    .venv/bin/python bench/sleeps_in_flight.py [--experiments 16] [--task-s 2] [--in-flight 1,4] [--jail none]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.001)


class Agent:
    """Commits sleeps through `requests/` as the tool does, and reads answers and wakes."""

    def __init__(self, ws: Path, task_s: float) -> None:
        self.ch = ws / ".syscall"
        self.task_s = task_s
        self.n = 0
        self.refused = 0

    def commit(self) -> str:
        """Commit the next sleep; retried at once while the kernel refuses it as in progress. Its id."""
        while True:
            self.n += 1
            rid = f"e{self.n:04d}"
            req = {
                "protocol": 1,
                "id": rid,
                "type": "sleep",
                "launches": [{"name": "exp", "command": f"sleep {self.task_s}", "minutes": 5}],
            }
            tmp = self.ch / "requests" / f".{rid}.tmp"
            tmp.write_text(json.dumps(req))
            os.rename(tmp, self.ch / "requests" / f"{rid}.json")
            answer = self.ch / "answers" / f"{rid}.json"
            wait_for(answer.exists, 120, f"the answer to {rid}")
            got = json.loads(answer.read_text())
            if got["type"] == "accepted":
                return rid
            if got.get("error", {}).get("code") != "sleep.in_progress":
                raise SystemExit(f"{rid} refused: {got}")
            self.refused += 1

    def woken(self, rid: str) -> bool:
        return (self.ch / "wakes" / f"{rid}.md").exists()


def scenario(top: Path, in_flight: int, experiments: int, task_s: float, jail: str) -> dict[str, object]:
    ws = top / f"ws-{in_flight}"
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    (ws / "train.py").write_text("print('x')\n")
    state = top / f"state-{in_flight}"
    config = top / f"config-{in_flight}.toml"
    config.write_text(
        ("allow_root = true\n" if os.geteuid() == 0 else "")
        + f'state_dir = "{state}"\njail = "{jail}"\n'
        + f"[defaults]\nmax_sleeps_in_flight = {in_flight}\n[local]\nmax_parallel = 8\n"
    )
    cli = [sys.executable, "-m", "kernel.cli"]
    subprocess.run(
        [*cli, "enroll", str(ws), "--launches", "1000", "--sleeps", "1000", "--config", str(config)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    log_path = top / f"kernel-{in_flight}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*cli, "serve", "--config", str(config)], cwd=ROOT, stdout=log, stderr=log, env=env
        )
    try:
        wait_for(lambda: b"event=ready" in log_path.read_bytes(), 60, "the kernel's ready")
        agent = Agent(ws, task_s)
        t0 = time.perf_counter()
        running: list[str] = []
        done = 0
        started = 0
        while done < experiments:
            while started < experiments and len(running) < in_flight:
                running.append(agent.commit())
                started += 1
            woke = [rid for rid in running if agent.woken(rid)]
            if not woke:
                time.sleep(0.001)
                continue
            for rid in woke:
                running.remove(rid)
                done += 1
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(60)
    return {
        "max_sleeps_in_flight": in_flight,
        "experiments": experiments,
        "task_s": task_s,
        "jail": jail,
        "wall_s": round(wall, 1),
        "experiments_per_min": round(experiments / wall * 60, 1),
        "refused_in_progress": agent.refused,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiments", type=int, default=16)
    ap.add_argument("--task-s", type=float, default=2.0)
    ap.add_argument("--in-flight", default="1,4")
    ap.add_argument("--jail", default="none", choices=("none", "bwrap"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-inflight-", dir=os.environ.get("BENCH_TMP")) as top:
        for n in (int(x) for x in args.in_flight.split(",")):
            print(json.dumps(scenario(Path(top), n, args.experiments, args.task_s, args.jail)), flush=True)


if __name__ == "__main__":
    main()
