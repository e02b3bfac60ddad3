"""The Slurm backend on the REAL throwaway cluster (`./dev test` starts it): real job wrappers on real snapshots.

Independent launches run concurrently inside one test to keep the suite lean. Timing facts come from the
wrapper's own `started`/`ended` files; every wait is on a condition with a deadline. The cluster runs jobs as
root; the jail is `none` except where a test says `bwrap`.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
from kernelproc import PLAIN_GIT

from kernel.backends import jobscript
from kernel.backends.base import JobSpec, TaskExit
from kernel.backends.slurm import SbatchJob, SbatchPolicy, render_sbatch_argv
from kernel.backends.slurm import backend as B
from kernel.io import snapshot as S
from kernel.io.repo import KernelRepo
from kernel.node.jail import JailPolicy

pytestmark = pytest.mark.slurm

T = TypeVar("T")
WS = "it-abcdef0123"
SLURM_CLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "slurm-cluster"
# Small jobs; no setup slack so `minutes` is Slurm's --time; the wrapper is warned 30 s before the walltime.
POLICY = SbatchPolicy(mem_mb=64, setup_slack_minutes=0, warn_seconds=30)


@dataclass
class World:
    env: dict[str, str]
    ws: Path
    run_dir: Path
    scratch: Path
    snap: S.Snapshot
    seq: int = 0

    def spec(self, launch: str, command: str, **kw: Any) -> JobSpec:
        self.seq += 1
        fields: dict[str, Any] = {
            "workspace": WS,
            "workspace_path": str(self.ws),
            "seq": self.seq,
            "launch": launch,
            "run_dir": str(self.run_dir),
            "command": command,
            "commit": self.snap.commit,
            "tree": self.snap.tree,
            "minutes": 5,
            "jail": JailPolicy(kind="none"),
            "scratch": str(self.scratch),
            "kill_grace_s": 2.0,
        }
        fields.update(kw)
        spec = JobSpec(**fields)
        jobscript.write_launch(spec)
        return spec

    def backend(self, **kw: Any) -> B.SlurmBackend:
        args: dict[str, Any] = {
            "policy": POLICY,
            "env": self.env,
            "poll_floor_s": 0.5,
            "poll_ceiling_s": 2.0,
            "file_poll_s": 0.2,
            "exit_grace_s": 2.0,
        }
        args.update(kw)
        return B.SlurmBackend(**args)

    def slurm(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def world(slurm_conf: Path, tmp_path: Path) -> Iterator[World]:
    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=ws, env=PLAIN_GIT, check=True)
    (ws / "train.py").write_text("print('committed')\n")
    subprocess.run(["git", "add", "-A"], cwd=ws, env=PLAIN_GIT, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=ws, env=PLAIN_GIT, check=True)
    (tmp_path / "ktmp").mkdir()
    (tmp_path / "runs").mkdir()
    repo = KernelRepo.at(tmp_path / "runs", WS)
    snap = anyio.run(lambda: S.take_snapshot(ws, repo, 1, tmp_dir=tmp_path / "ktmp"))
    (tmp_path / "scratch").mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_CONF": str(slurm_conf)}
    w = World(env, ws, tmp_path / "runs", tmp_path / "scratch", snap)
    yield w
    # Never leave a job of this test behind, whatever it asserted.
    for job_file in w.run_dir.rglob(B.JOB_FILE):
        w.slurm("scancel", msgspec.json.decode(job_file.read_bytes(), type=B.JobRecord).job_id)


def served(b: B.SlurmBackend, fn: Callable[[B.SlurmBackend], Awaitable[T]]) -> T:
    async def main() -> T:
        async with anyio.create_task_group() as tg:
            await tg.start(b.run)
            try:
                return await fn(b)
            finally:
                tg.cancel_scope.cancel()

    return anyio.run(main)


async def exits(b: B.SlurmBackend, n: int, seconds: float) -> list[TaskExit]:
    with anyio.fail_after(seconds):
        return [await b.wait_any_exit() for _ in range(n)]


async def until(cond: Callable[[], bool], seconds: float, what: str) -> None:
    with anyio.fail_after(seconds):
        while True:
            if cond():
                return
            await anyio.sleep(0.1)
    raise AssertionError(what)  # pragma: no cover (fail_after raises first)


def outcome(spec: JobSpec, task: int = 0) -> tuple[str, int, str]:
    rec = jobscript.read_exit(spec.task_dir(task))
    st = B.read_task_state(spec.task_dir(task))
    assert rec is not None, f"{spec.key} task {task}: no exit-code"
    assert st is not None, f"{spec.key} task {task}: no slurm-state.json"
    return st.state, rec.code, rec.kind


def spans(spec: JobSpec) -> list[tuple[float, float]]:
    out = []
    for k in range(spec.array):
        s = jobscript.read_timestamp(spec.task_dir(k), "started")
        e = jobscript.read_timestamp(spec.task_dir(k), "ended")
        assert s is not None
        assert e is not None
        out.append((s.timestamp(), e.timestamp()))
    return out


def test_sweep_failure_cancels_and_adoption_on_the_real_cluster(world: World) -> None:
    sweep = world.spec("sweep", "sleep 2; echo task $SWEEP_INDEX", array=4, concurrency=2)
    failing = world.spec("failing", "echo failing >&2; exit 3")
    ours = world.spec("ours", "sleep 300", array=3, concurrency=1)  # task 0 runs, 1 and 2 wait
    outside = world.spec("outside", "sleep 300")
    # A kernel that died after sbatch, before recording the id: the job exists, only slurm.json is on disk.
    orphan = world.spec("orphan", "sleep 3; echo adopted")
    orphan.paths.launch_dir.joinpath(B.SPEC_FILE).write_bytes(msgspec.json.encode(orphan))
    argv = render_sbatch_argv(
        SbatchJob(workspace=WS, seq=orphan.seq, launch="orphan", minutes=5), POLICY, orphan.paths
    )
    made = world.slurm(*argv)
    assert made.returncode == 0, made.stderr
    orphan_id = made.stdout.strip().split(";")[0]

    async def go(b: B.SlurmBackend) -> dict[tuple[str, int], TaskExit]:
        found = await b.recover(world.run_dir)
        assert [(r.key, r.job_id) for r in found.running] == [(orphan.key, orphan_id)]
        assert not found.requeued
        for spec in (sweep, failing, ours, outside):
            await b.submit(spec)
        await until(lambda: (ours.task_dir(0) / "started").exists(), 60, "task 0 of `ours` to start")
        await until(lambda: (outside.task_dir(0) / "started").exists(), 60, "`outside` to start")
        cancelled = await b.cancel(ours.key)
        assert sorted(r.task for r in cancelled) == [0, 1, 2]
        job = b.job_of(outside.key)
        assert job is not None
        assert world.slurm("scancel", job.job_id).returncode == 0
        return {(e.key, e.task): e for e in await exits(b, 4 + 1 + 3 + 1 + 1, 180)}

    got = served(world.backend(), go)
    want = {(s.key, k) for s in (sweep, failing, ours, outside, orphan) for k in range(s.array)}
    assert set(got) == want
    # Slurm throttled the sweep to 2 at once (its own started/ended records), and 2 did overlap.
    sp = spans(sweep)
    assert max(sum(1 for s, e in sp if s <= t < e) for t, _ in sp) == 2, sp
    assert [outcome(sweep, k) for k in range(4)] == [("COMPLETED", 0, "exited")] * 4
    assert (sweep.task_dir(3) / "stdout").read_text() == "task 3\n"
    assert outcome(failing) == ("FAILED", 3, "exited")
    # The running task's wrapper caught scancel's SIGTERM; the two waiting tasks never started.
    assert outcome(ours, 0) == ("CANCELLED", jobscript.EXIT_TERMINATED, "terminated")
    assert [outcome(ours, k) for k in (1, 2)] == [("CANCELLED", jobscript.EXIT_TERMINATED, "cancelled")] * 2
    assert not (ours.task_dir(1) / "started").exists()
    assert outcome(outside) == ("CANCELLED", jobscript.EXIT_TERMINATED, "terminated")
    hint = B.read_task_state(outside.task_dir(0))
    assert hint is not None
    assert "outside the kernel" in (hint.hint or "")
    assert outcome(orphan) == ("COMPLETED", 0, "exited")
    # No duplicate: Slurm knows exactly one job of that name in this run directory (earlier runs of this test
    # left jobs of the same name elsewhere, which were not adopted either).
    listed = world.slurm("squeue", "-h", "-t", "all", "-o", "%i|%Z", f"--name=sk-{WS}-{orphan.seq}-orphan")
    mine = [
        line.split("|")[0] for line in listed.stdout.split() if line.endswith(f"|{orphan.paths.launch_dir}")
    ]
    assert mine == [orphan_id]


def test_controller_down_for_30s_reports_nothing_failed(world: World, slurm_conf: Path) -> None:
    short = world.spec("short", "sleep 12")  # ends while slurmctld is down
    long = world.spec("long", "sleep 45")  # ends after it is back
    ctl = str(slurm_conf.parent)

    async def go(b: B.SlurmBackend) -> tuple[list[TaskExit], list[TaskExit], int]:
        await b.submit(short)
        await b.submit(long)
        await until(
            lambda: all((s.task_dir(0) / "started").exists() for s in (short, long)), 60, "both to run"
        )
        stopped = await anyio.run_process([str(SLURM_CLUSTER), "ctl-stop", ctl], check=False)
        assert stopped.returncode == 0, stopped.stderr
        during: list[TaskExit] = []
        try:
            with anyio.move_on_after(30):  # the outage itself: the scenario, not a wait for settling
                while True:
                    during.append(await b.wait_any_exit())
            failures = b._failures
        finally:
            started = await anyio.run_process([str(SLURM_CLUSTER), "ctl-start", ctl], check=False)
            assert started.returncode == 0, started.stderr
        after = await exits(b, 2 - len(during), 120)
        return during, after, failures

    during, after, failures = served(world.backend(client_timeout_s=20.0), go)
    assert failures >= 1, "squeue must have failed while slurmctld was down"
    # The short job's wrapper wrote its exit file during the outage: reported from the file, as COMPLETED.
    assert [e.key for e in during] == [short.key]
    assert [e.key for e in after] == [long.key]
    assert outcome(short) == outcome(long) == ("COMPLETED", 0, "exited")


@pytest.mark.slow
def test_walltime_kill_reads_timeout(world: World) -> None:
    spec = world.spec("walltime", "echo ready; sleep 600", minutes=1)

    async def go(b: B.SlurmBackend) -> list[TaskExit]:
        await b.submit(spec)
        # --time=1 and the warning 30 s before it, give or take Slurm's resolution (up to 60 s early).
        return await exits(b, 1, 180)

    (e,) = served(world.backend(), go)
    assert e.key == spec.key
    state, code, kind = outcome(spec)
    assert (state, code, kind) == ("TIMEOUT", jobscript.EXIT_TIMEOUT, "timeout")
    started = jobscript.read_timestamp(spec.task_dir(0), "started")
    ended = jobscript.read_timestamp(spec.task_dir(0), "ended")
    assert started is not None
    assert ended is not None
    # Slurm sends the warning up to a minute early (its event resolution): the wrapper stops the command then.
    assert 0 < (ended - started).total_seconds() <= 100
    assert (spec.task_dir(0) / "stdout").read_text() == "ready\n"


@pytest.mark.bwrap
def test_bwrap_jail_under_slurmd(world: World, bwrap_available: None) -> None:
    """bwrap works under slurmd here (jobs run as root): the job sees its tree, not the run dir, its own UTS."""
    spec = world.spec(
        "jailed", f"cat train.py; test ! -e {world.run_dir}/{WS}; hostname", jail=JailPolicy(kind="bwrap")
    )

    async def go(b: B.SlurmBackend) -> list[TaskExit]:
        await b.submit(spec)
        return await exits(b, 1, 60)

    served(world.backend(), go)
    assert outcome(spec) == ("COMPLETED", 0, "exited"), (spec.task_dir(0) / "stderr").read_text()
    out = (spec.task_dir(0) / "stdout").read_text().splitlines()
    assert out[0] == "print('committed')"
    assert out[1] != socket.gethostname()
