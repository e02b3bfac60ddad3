"""Scheduler load of the Slurm backend: squeue/sacct/sbatch invocations per poll interval and per minute.

Fake scenarios (10, 1,000 and 10,000 tracked jobs): the fake Slurm (tests/fakes/fake_slurm.py) counts every client
invocation with its time. The jobs are recorded in the run directory as a previous kernel would have left them
and adopted with `recover()`; the backend's real service loop then runs for the window while the jobs go
PENDING -> RUNNING (a third of the window) -> ended with their exit files written (two thirds), the happy path.
The clock may be compressed (`--compress K` divides the poll floor and ceiling by K and reports per-minute rates
scaled back to uncompressed time): the counts per poll interval do not depend on it.

Real scenario (when SLURM_CONF names a running cluster, e.g. under `./dev test`, or `--real-conf`): 100 launches
with real job wrappers (`sleep 1`, jail none) submitted through the backend to the throwaway cluster and tracked
to their end, with counting shims on PATH in front of the real clients.

Prints one JSON object per scenario. Usage:
    .venv/bin/python bench/scheduler_load.py [--counts 10,1000,10000] [--seconds 30] [--compress 4]
                                             [--real-jobs 100] [--real-conf PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from fakes.fake_slurm import FakeSlurm  # noqa: E402

from kernel.backends import jobscript  # noqa: E402
from kernel.backends.base import JobSpec  # noqa: E402
from kernel.backends.slurm import SbatchPolicy  # noqa: E402
from kernel.backends.slurm import backend as B  # noqa: E402
from kernel.io import snapshot as S  # noqa: E402
from kernel.io.repo import KernelRepo  # noqa: E402
from kernel.node.jail import JailPolicy  # noqa: E402

WS = "bench-0123456789"
FLOOR_S, CEILING_S = 2.0, 60.0  # the backend's defaults


def spec_for(run_dir: Path, i: int, **kw: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "workspace": WS,
        "workspace_path": "/nonexistent",
        "seq": i,
        "launch": "main",
        "run_dir": str(run_dir),
        "command": "true",
        "commit": "0" * 40,
        "tree": "1" * 40,
        "minutes": 5,
        "jail": JailPolicy(kind="none"),
    }
    fields.update(kw)
    return JobSpec(**fields)


async def serve(b: B.SlurmBackend, body: Callable[[], Awaitable[None]]) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(b.run)
        try:
            await body()
        finally:
            tg.cancel_scope.cancel()


def gaps(times: list[float]) -> dict[str, float | None]:
    d = [b - a for a, b in itertools.pairwise(times)]
    return {"min_gap_s": round(min(d), 3) if d else None, "max_gap_s": round(max(d), 3) if d else None}


def fake_scenario(count: int, seconds: float, compress: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sched-load-") as tmp:
        root = Path(tmp)
        fake = FakeSlurm(root / "fake")
        run_dir = root / "runs"
        ids = fake.add_jobs(count)
        specs = []
        for i, job_id in enumerate(ids):
            spec = spec_for(run_dir, i)
            spec.paths.launch_dir.mkdir(parents=True)
            B._write_json(spec.paths.launch_dir, B.SPEC_FILE, spec)
            B._write_json(spec.paths.launch_dir, B.JOB_FILE, B.JobRecord(job_id, "bench", time.time()))
            specs.append(spec)
        floor, ceiling = FLOOR_S / compress, CEILING_S / compress
        b = B.SlurmBackend(
            env=fake.env(), poll_floor_s=floor, poll_ceiling_s=ceiling, file_poll_s=1.0 / compress
        )
        moved = specs[: max(1, count // 10)]
        exits: list[float] = []
        cycle_s: list[float] = []
        t0 = 0.0

        async def body() -> None:
            nonlocal t0
            recovered = await b.recover(run_dir)
            assert len(recovered.running) == count
            t0 = time.time()

            async def collect() -> None:
                while True:
                    await b.wait_any_exit()
                    exits.append(time.time() - t0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                await anyio.sleep(seconds / 3)
                moves: list[tuple[str, int | None, str]] = [
                    (ids[i], None, "RUNNING") for i in range(len(moved))
                ]
                fake.set_states(moves)
                await anyio.sleep(seconds / 3)
                for spec in moved:  # the wrappers finish: exit files first, then Slurm's COMPLETED
                    jobscript.write_exit(spec.task_dir(0), jobscript.ExitRecord(0, "exited"))
                fake.set_states([(j, t, "COMPLETED") for j, t, _ in moves])
                await anyio.sleep(seconds / 3)
                tg.cancel_scope.cancel()

        anyio.run(serve, b, body)
        b.close()
        log = [(t - t0, c) for t, c in fake.call_log() if t >= t0]
        squeue_t = [t for t, c in log if c == "squeue"]
        # Cost of one squeue on the fake at this size (bounds how fast the loop could go).
        for _ in range(3):
            s0 = time.perf_counter()
            subprocess.run(
                ["squeue", "-h", "-r", "-t", "all", "-o", "%i", "-j", ",".join(ids)],
                env=fake.env(),
                capture_output=True,
                check=True,
            )
            cycle_s.append(time.perf_counter() - s0)
        counts = {c: sum(1 for _, x in log if x == c) for c in ("squeue", "sacct", "sbatch", "scancel")}
        minutes = seconds * compress / 60.0  # uncompressed time the window stands for
        return {
            "scenario": f"fake-{count}",
            "tracked_jobs": count,
            "window_s": seconds,
            "compress": compress,
            "poll_floor_s": floor,
            "poll_ceiling_s": ceiling,
            "invocations": counts,
            "per_minute_uncompressed": {c: round(n / minutes, 2) for c, n in counts.items()},
            "squeue_per_poll_interval_max": max_in_window(squeue_t, floor),
            "squeue_gaps": gaps(squeue_t),
            "fake_squeue_seconds": round(min(cycle_s), 3),
            "exits_reported": len(exits),
            "exits_expected": len(moved),
            "exit_latency_s_max": round(max(exits) - 2 * seconds / 3, 3) if exits else None,
        }


def max_in_window(times: list[float], window: float) -> int:
    """The most calls that fell within any `window` seconds (1 = never two in one poll floor)."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def counting_shims(bin_dir: Path, log: Path) -> None:
    bin_dir.mkdir()
    for cmd in ("sbatch", "squeue", "sacct", "scancel"):
        real = shutil.which(cmd)
        if real is None:
            raise SystemExit(f"{cmd} is not installed")
        shim = bin_dir / cmd
        shim.write_text(f'#!/bin/sh\necho "$(date +%s.%N) {cmd}" >> {log}\nexec {real} "$@"\n')
        shim.chmod(0o755)


def real_scenario(conf: Path, jobs: int) -> dict[str, Any]:
    plain = {
        "PATH": "/usr/bin:/bin",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_SYSTEM": "/dev/null",
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@example.invalid",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@example.invalid",
    }
    with tempfile.TemporaryDirectory(prefix="sched-load-real-") as tmp:
        root = Path(tmp)
        ws = root / "ws"
        ws.mkdir()
        subprocess.run(["git", "init", "-q"], cwd=ws, env=plain, check=True)
        (ws / "f").write_text("x\n")
        subprocess.run(["git", "add", "-A"], cwd=ws, env=plain, check=True)
        subprocess.run(["git", "commit", "-qm", "i"], cwd=ws, env=plain, check=True)
        (root / "ktmp").mkdir()
        repo = KernelRepo.at(root / "runs", WS)
        snap = anyio.run(lambda: S.take_snapshot(ws, repo, 1, tmp_dir=root / "ktmp"))
        log = root / "calls.log"
        log.touch()
        counting_shims(root / "bin", log)
        env = {"PATH": f"{root / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}", "SLURM_CONF": str(conf)}
        run_dir = root / "runs"
        specs = []
        for i in range(jobs):
            spec = spec_for(
                run_dir,
                i,
                workspace_path=str(ws),
                commit=snap.commit,
                tree=snap.tree,
                command="sleep 1",
                scratch=str(root),
            )
            jobscript.write_launch(spec)
            specs.append(spec)
        b = B.SlurmBackend(env=env, policy=SbatchPolicy(mem_mb=64, setup_slack_minutes=0), exit_grace_s=5.0)
        t0 = time.time()
        states: list[str] = []

        async def body() -> None:
            for spec in specs:
                await b.submit(spec)
            with anyio.fail_after(900):
                for _ in specs:
                    e = await b.wait_any_exit()
                    st = B.read_task_state(Path(e.task_dir))
                    states.append(st.state if st else "?")

        anyio.run(serve, b, body)
        b.close()
        elapsed = time.time() - t0
        entries = [line.split() for line in log.read_text().splitlines()]
        counts = {c: sum(1 for _, x in entries if x == c) for c in ("squeue", "sacct", "sbatch", "scancel")}
        squeue_t = [float(t) - t0 for t, x in entries if x == "squeue"]
        return {
            "scenario": f"real-{jobs}",
            "tracked_jobs": jobs,
            "window_s": round(elapsed, 1),
            "poll_floor_s": FLOOR_S,
            "poll_ceiling_s": CEILING_S,
            "invocations": counts,
            "per_minute": {c: round(n * 60 / elapsed, 2) for c, n in counts.items()},
            "squeue_per_poll_interval_max": max_in_window(squeue_t, FLOOR_S),
            "squeue_gaps": gaps(squeue_t),
            "states": {s: states.count(s) for s in sorted(set(states))},
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="10,1000,10000")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--compress", type=float, default=4.0)
    ap.add_argument("--real-jobs", type=int, default=100)
    ap.add_argument("--real-conf", default=os.environ.get("SLURM_CONF", ""))
    args = ap.parse_args()
    for count in (int(c) for c in args.counts.split(",") if c):
        print(json.dumps(fake_scenario(count, args.seconds, args.compress)), flush=True)
    if args.real_conf and Path(args.real_conf).is_file() and args.real_jobs > 0:
        print(json.dumps(real_scenario(Path(args.real_conf), args.real_jobs)), flush=True)


if __name__ == "__main__":
    main()
