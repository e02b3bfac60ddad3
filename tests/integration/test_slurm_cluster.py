"""The throwaway Slurm cluster (scripts/slurm-cluster, started by `./dev test`) driven with kernel.backends.slurm's argv
and read with its parsers: Slurm throttles an array to its %K, squeue's forms parse, scancel and the walltime
classify as CANCELLED and TIMEOUT, sacct without accounting is recognized, and the fake Slurm reads the same.

The walltime job is submitted by the first test and checked by the last one, so the minute it needs (Slurm
enforces `--time` in whole minutes, checked every 30 s) overlaps the other tests.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from fakes.fake_slurm import FakeSlurm

from channel.paths import RunPaths
from kernel.backends.slurm import (
    Resolution,
    SbatchJob,
    SbatchPolicy,
    SqueueResult,
    TaskKey,
    parse_sbatch_output,
    parse_squeue,
    read_sacct,
    read_squeue,
    render_sbatch_argv,
    resolve_task,
    sacct_argv,
    squeue_argv,
)
from kernel.backends.slurm.query import SQUEUE_FORMAT

pytestmark = pytest.mark.slurm

WS = "it-0123456789"
SLURM_CLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "slurm-cluster"
POLICY = SbatchPolicy(mem_mb=64, setup_slack_minutes=0, warn_seconds=120)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}

# Records start and end in the task's run directory, as the kernel's wrapper will (exit-code last).
TASK_SCRIPT = """#!/bin/sh
dir="{sleep_dir}/{launch}.$SLURM_ARRAY_TASK_ID"
date +%s.%N > "$dir/started"
sleep {seconds}
date +%s.%N > "$dir/ended"
echo 0 > "$dir/exit-code"
"""
# `wait` returns on a trapped signal at once, so the trap runs when USR2 arrives: with a foreground `sleep` bash
# runs it only after the sleep, and a time-limit SIGTERM arriving just after the warning (a loaded controller
# may send both in one pass) killed the shell first.
WALLTIME_SCRIPT = """#!/bin/bash
trap 'date +%s > "{launch_dir}/warned"' USR2
while :; do sleep 1 & wait $!; done
"""


class Cluster:
    def __init__(self, conf: Path, run_dir: Path) -> None:
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        self.run_dir = run_dir
        self.seq = 0

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60, check=False)

    def stage(
        self,
        launch: str,
        script: str,
        *,
        minutes: int = 5,
        array: int = 1,
        concurrency: int = 0,
        mem_mb: int | None = None,
        cpus: int | None = None,
    ) -> list[str]:
        """Write job.sh and the task directories; return the sbatch argv."""
        self.seq += 1
        paths = RunPaths(self.run_dir, WS, self.seq, launch)
        for k in range(array):
            paths.task_dir(k, array).mkdir(parents=True, exist_ok=True)
        paths.launch_dir.mkdir(parents=True, exist_ok=True)
        body = script.format(sleep_dir=paths.sleep_dir, launch=launch, launch_dir=paths.launch_dir, seconds=2)
        (paths.launch_dir / paths.JOB_SCRIPT).write_text(body)
        (paths.launch_dir / paths.JOB_SCRIPT).chmod(0o755)
        job = SbatchJob(
            workspace=WS,
            seq=self.seq,
            launch=launch,
            minutes=minutes,
            array=array,
            concurrency=concurrency,
            mem_mb=mem_mb,
            cpus=cpus,
        )
        return render_sbatch_argv(job, POLICY, paths)

    def submit(self, argv: list[str]) -> str:
        out = self.run(argv)
        assert out.returncode == 0, f"sbatch failed: {out.stderr}"
        return parse_sbatch_output(out.stdout).job_id

    def squeue(self, ids: list[str]) -> SqueueResult:
        out = self.run(squeue_argv(ids))
        return read_squeue(out.returncode, out.stdout, out.stderr, ids)

    def wait(
        self, ids: list[str], done: Callable[[SqueueResult], bool], what: str, deadline_s: float = 60
    ) -> SqueueResult:
        deadline = time.monotonic() + deadline_s
        while True:
            q = self.squeue(ids)
            if q.known and done(q):
                return q
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {deadline_s} s waiting for {what}; last squeue: {q}")
            time.sleep(0.25)

    def cancel(self, *ids: str) -> None:
        self.run(["scancel", *ids])


def _all_ended(keys: set[TaskKey]) -> Callable[[SqueueResult], bool]:
    return lambda q: keys <= q.entries.keys() and all(q.entries[k].state in ENDED for k in keys)


@pytest.fixture(scope="module")
def cluster(slurm_conf: Path, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    return Cluster(slurm_conf, tmp_path_factory.mktemp("slurm-run"))


@pytest.fixture(scope="module")
def walltime_job(cluster: Cluster) -> Iterator[tuple[str, Path]]:
    argv = cluster.stage("walltime", WALLTIME_SCRIPT, minutes=1)
    job = cluster.submit(argv)
    yield job, Path(argv[-1]).parent
    cluster.cancel(job)


def test_array_is_throttled_by_slurm(cluster: Cluster, walltime_job: tuple[str, Path]) -> None:
    argv = cluster.stage("sweep", TASK_SCRIPT, array=4, concurrency=2)
    assert "--array=0-3%2" in argv
    job = cluster.submit(argv)
    try:
        keys: set[TaskKey] = {(job, k) for k in range(4)}
        peak = 0

        def done(q: SqueueResult) -> bool:
            nonlocal peak
            peak = max(peak, sum(1 for k in keys if k in q.entries and q.entries[k].state == "RUNNING"))
            return _all_ended(keys)(q)

        q = cluster.wait([job], done, "the 4 array tasks to end")
    finally:
        cluster.cancel(job)
    assert {q.entries[k].state for k in keys} == {"COMPLETED"}
    assert peak <= 2
    sleep_dir = Path(argv[-1]).parent.parent
    spans = [
        (
            float((sleep_dir / f"sweep.{k}" / "started").read_text()),
            float((sleep_dir / f"sweep.{k}" / "ended").read_text()),
        )
        for k in range(4)
    ]
    # The tasks' own records: never more than 2 at once, and 2 did run together (the throttle, not a serial queue).
    overlap = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert overlap == 2, spans
    for k in range(4):
        code = int((sleep_dir / f"sweep.{k}" / "exit-code").read_text())
        assert resolve_task((job, k), exit_code=code, queue=q).state == "COMPLETED"
        assert (sleep_dir / f"sweep.{k}" / "scheduler.out").exists()


def test_a_launchs_own_memory_and_cpus_are_what_slurm_allocates(cluster: Cluster) -> None:
    """`launch --mem 48 --cpus 2` reaches Slurm as the job's allocation (the site default here is 64 MB, 1 CPU);
    the job runs with them."""
    job = cluster.submit(cluster.stage("sized", "#!/bin/sh\nnproc\n", mem_mb=48, cpus=2))
    shown = cluster.run(["scontrol", "show", "job", "-o", job])
    assert shown.returncode == 0, shown.stderr
    fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
    assert fields["MinMemoryNode"] == "48M", shown.stdout
    assert (fields["NumCPUs"], fields["CPUs/Task"]) == ("2", "2"), shown.stdout
    key: TaskKey = (job, None)
    q = cluster.wait([job], _all_ended({key}), "the sized job to end")
    assert q.entries[key].state == "COMPLETED"
    plain = cluster.submit(cluster.stage("unsized", "#!/bin/sh\ntrue\n"))
    fields = dict(
        f.split("=", 1)
        for f in cluster.run(["scontrol", "show", "job", "-o", plain]).stdout.split()
        if "=" in f
    )
    assert (fields["MinMemoryNode"], fields["CPUs/Task"]) == ("64M", "1")
    cluster.cancel(plain)


def test_squeue_forms_and_the_single_id_pitfall(cluster: Cluster) -> None:
    argv = cluster.stage("held", TASK_SCRIPT, array=6, concurrency=2)
    job = cluster.submit([*argv[:-1], "--hold", argv[-1]])
    try:
        split = cluster.squeue([job])
        combined = cluster.run(["squeue", "-h", "-t", "all", "-o", SQUEUE_FORMAT, "-j", job])
        assert f"{job}_[0-5%2]|" in combined.stdout
        assert set(parse_squeue(combined.stdout)) == set(split.entries) == {(job, k) for k in range(6)}
        assert {e.reason for e in split.entries.values()} == {"JobHeldUser"}
        # A hold never clears by itself: the sleep is woken with the reason rather than parked forever.
        stuck = {resolve_task((job, k), exit_code=None, queue=split) for k in range(6)}
        assert {(r.action, r.state) for r in stuck} == {("stuck", "PENDING")}
        assert all(r.hint and "JobHeldUser" in r.hint for r in stuck)
    finally:
        cluster.cancel(job)
    unknown = str(int(job) + 100_000)
    single = cluster.run(squeue_argv([unknown]))
    assert single.returncode == 1
    gone = read_squeue(single.returncode, single.stdout, single.stderr, [unknown])
    assert (gone.known, gone.entries) == (True, {})
    pair = cluster.squeue([unknown, str(int(unknown) + 1)])
    assert (pair.known, pair.entries) == (True, {})


def test_scancel_outside_the_kernel_classifies_as_cancelled(cluster: Cluster) -> None:
    argv = cluster.stage("victim", "#!/bin/sh\nsleep 300\n")
    job = cluster.submit(argv)
    key = (job, None)
    cluster.wait([job], lambda q: key in q.entries and q.entries[key].state == "RUNNING", "the job to run")
    assert cluster.run(["scancel", job]).returncode == 0
    q = cluster.wait([job], _all_ended({key}), "the cancelled job to end")
    assert q.entries[key].state == "CANCELLED"
    first = resolve_task(key, exit_code=None, queue=q)
    assert first.action == "ask_accounting"
    out = cluster.run(sacct_argv([job], datetime.now()))
    acct = read_sacct(out.returncode, out.stdout, out.stderr)
    assert acct.status == "disabled"  # the throwaway cluster has no slurmdbd
    final = resolve_task(key, exit_code=None, queue=q, accounting=acct)
    assert (final.action, final.state) == ("done", "CANCELLED")


def test_the_fake_reads_like_the_real_cluster(cluster: Cluster, tmp_path: Path) -> None:
    fake = FakeSlurm(tmp_path / "fake")
    argv = cluster.stage("twin", TASK_SCRIPT, array=3, concurrency=2)
    held = [*argv[:-1], "--hold", argv[-1]]

    def scenario(run: Callable[[list[str]], subprocess.CompletedProcess[str]]) -> list[object]:
        sub = run(held)
        job = parse_sbatch_output(sub.stdout).job_id
        seen: list[object] = []
        for step in ("pending", "cancelled"):
            out = run(squeue_argv([job]))
            q = read_squeue(out.returncode, out.stdout, out.stderr, [job])
            seen.append((step, q.known, sorted((k[1], e.state, e.reason) for k, e in q.entries.items())))
            if step == "pending":
                assert run(["scancel", job]).returncode == 0
                _wait_states(run, job, "CANCELLED")
        acct = run(sacct_argv([job], datetime.now()))
        seen.append(read_sacct(acct.returncode, acct.stdout, acct.stderr).status)
        missing = run(squeue_argv([str(int(job) + 100_000)]))
        seen.append(
            (missing.returncode, read_squeue(missing.returncode, missing.stdout, missing.stderr, ["x"]).known)
        )
        return seen

    real = scenario(cluster.run)
    faked = scenario(
        lambda a: subprocess.run(a, env=fake.env(), capture_output=True, text=True, timeout=30, check=False)
    )
    assert real == faked
    assert real[0] == ("pending", True, [(k, "PENDING", "JobHeldUser") for k in range(3)])


def _wait_states(run: Callable[[list[str]], subprocess.CompletedProcess[str]], job: str, state: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        out = run(squeue_argv([job]))
        entries = parse_squeue(out.stdout) if out.returncode == 0 else {}
        if entries and all(e.state == state for e in entries.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"job {job} did not reach {state}: {out.stdout!r} {out.stderr!r}")
        time.sleep(0.2)


def test_controller_down_is_unknown_never_gone(cluster: Cluster, slurm_conf: Path) -> None:
    job = cluster.submit(cluster.stage("steady", "#!/bin/sh\nsleep 300\n"))
    key = (job, None)
    running = lambda q: key in q.entries and q.entries[key].state == "RUNNING"  # noqa: E731
    cluster.wait([job], running, "the job to run")
    ctl = [str(SLURM_CLUSTER), "ctl-stop", str(slurm_conf.parent)]
    assert cluster.run(ctl).returncode == 0
    try:
        # One id: the exit 1 here is "Unable to contact slurm controller", not the "Invalid job id" of a gone
        # job. (A client retries for 10-20 s against a dead controller, so this asks only once.)
        q = cluster.squeue([job])
        assert not q.known, q
        assert resolve_task(key, exit_code=None, queue=q) == Resolution("wait")
    finally:
        started = cluster.run([str(SLURM_CLUSTER), "ctl-start", str(slurm_conf.parent)])
        assert started.returncode == 0, started.stderr
    try:
        cluster.wait([job], running, "the job to be listed RUNNING again after slurmctld returned")
    finally:
        cluster.cancel(job)


@pytest.mark.slow
def test_walltime_kill_classifies_as_timeout(cluster: Cluster, walltime_job: tuple[str, Path]) -> None:
    job, launch_dir = walltime_job
    key = (job, None)
    # --time=1 plus Slurm's 30 s enforcement period: the kill comes 60-90 s after the start.
    q = cluster.wait([job], _all_ended({key}), "the walltime kill", deadline_s=180)
    assert q.entries[key].state == "TIMEOUT"
    assert q.entries[key].reason == "TimeLimit"
    got = resolve_task(key, exit_code=None, queue=q)
    assert (got.action, got.state) == ("done", "TIMEOUT")
    # --signal=B:USR2@120 reached the batch shell before the kill.
    assert (launch_dir / "warned").exists()
