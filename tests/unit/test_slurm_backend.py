"""The Slurm backend's logic against the fake Slurm (real subprocesses and files; jobs move when a test says so).

Scheduler load is asserted from the fake's own call counts: one squeue per cycle whatever the number of jobs, no
sacct on the happy path, sacct only for tasks that left the queue without an exit file.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
from fakes.fake_slurm import FakeSlurm
from testenv import fill, tmpfs

from channel.lifecycle import next_task_state
from kernel.backends import jobscript
from kernel.backends.base import BackendUnavailable, JobSpec, Recovered, TaskExit
from kernel.backends.slurm import Resolution, SbatchJob, SbatchPolicy, render_sbatch_argv
from kernel.backends.slurm import backend as S
from kernel.core.config import ConfigError, SlurmConfig, parse
from kernel.node.jail import JailPolicy
from kernel.service import gather
from kernel.service.factory import make_backend

T = TypeVar("T")
WS = "ws-0123456789"
TRANSIENT = "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"
DOWN = "squeue: error: Unable to contact slurm controller (connect failure)"


class World:
    def __init__(self, tmp: Path, **fake: Any) -> None:
        self.fake = FakeSlurm(tmp / "fake", **fake)
        self.run_dir = tmp / "runs"
        self.run_dir.mkdir()
        self.sleeps: list[float] = []
        self.backends: list[S.SlurmBackend] = []

    def spec(self, launch: str, *, seq: int = 1, write: bool = True, **kw: Any) -> JobSpec:
        fields: dict[str, Any] = {
            "workspace": WS,
            "workspace_path": "/nonexistent/ws",
            "seq": seq,
            "launch": launch,
            "run_dir": str(self.run_dir),
            "command": "true",
            "commit": "0" * 40,
            "tree": "1" * 40,
            "minutes": 1,
            "jail": JailPolicy(kind="none"),
        }
        fields.update(kw)
        spec = JobSpec(**fields)
        if write:
            jobscript.write_launch(spec)
        return spec

    def backend(self, **kw: Any) -> S.SlurmBackend:
        async def sleep(s: float) -> None:
            self.sleeps.append(s)

        args: dict[str, Any] = {
            "env": self.fake.env(),
            "exit_grace_s": 0.0,
            "client_timeout_s": 20.0,
            "sleep": sleep,
        }
        args.update(kw)
        b = S.SlurmBackend(**args)
        self.backends.append(b)
        return b

    def close(self) -> None:
        for b in self.backends:
            b.close()

    def calls(self) -> dict[str, int]:
        calls: dict[str, int] = self.fake.calls()
        return calls

    def jobs(self) -> dict[str, Any]:
        jobs: dict[str, Any] = self.fake.state()["jobs"]
        return jobs


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return anyio.run(fn)


async def wait_for(cond: Callable[[], bool], seconds: float = 20.0) -> None:
    with anyio.fail_after(seconds):
        while True:
            if cond():
                return
            await anyio.sleep(0.02)


def drain(b: S.SlurmBackend) -> list[TaskExit]:
    """Every exit reported so far (without waiting)."""
    out: list[TaskExit] = []
    while True:
        try:
            out.append(b._exits_out.receive_nowait())
        except anyio.WouldBlock:
            return out


def exit_of(spec: JobSpec, task: int = 0) -> jobscript.ExitRecord:
    rec = jobscript.read_exit(spec.task_dir(task))
    assert rec is not None, f"no exit-code for {spec.key} task {task}"
    return rec


def state_of(spec: JobSpec, task: int = 0) -> S.TaskSlurmState:
    st = S.read_task_state(spec.task_dir(task))
    assert st is not None
    return st


@pytest.fixture
def w(tmp_path: Path) -> Iterator[World]:
    world = World(tmp_path)
    yield world
    world.close()


# --- submission --------------------------------------------------------------------------------------------


def test_submit_renders_the_argv_and_records_the_job_id(w: World) -> None:
    spec = w.spec("sweep", array=4, concurrency=2, minutes=3)
    b = w.backend(policy=SbatchPolicy(mem_mb=512, setup_slack_minutes=2, warn_seconds=90, partition="debug"))
    refs = run(lambda: b.submit(spec))
    args = w.fake.last_args("sbatch")
    name = f"sk-{WS}-1-sweep"
    assert f"--job-name={name}" in args
    assert {"--parsable", "--array=0-3%2", "--time=5", "--mem=512M", "--partition=debug"} <= set(args)
    assert {"--signal=B:USR2@90", "--kill-on-invalid-dep=yes"} <= set(args)
    assert f"--output={spec.paths.sleep_dir}/sweep.%a/scheduler.out" in args
    assert args[-1] == str(spec.paths.launch_dir / "job.sh")
    (job_id,) = w.jobs()
    assert [r.job_id for r in refs] == [f"{job_id}_{k}" for k in range(4)]
    rec = msgspec.json.decode((spec.paths.launch_dir / S.JOB_FILE).read_bytes(), type=S.JobRecord)
    assert (rec.job_id, rec.name, rec.adopted) == (job_id, name, False)
    assert all(spec.task_dir(k).is_dir() for k in range(4)), "Slurm does not create output directories"
    assert w.calls() == {"sbatch": 1, "squeue": 0, "sacct": 0, "scancel": 0}  # a fresh launch: no lookup
    # Idempotent per key: a second submit asks nothing.
    assert run(lambda: b.submit(spec)) == refs
    assert w.calls()["sbatch"] == 1


def test_a_launchs_own_memory_and_cpus_reach_sbatch_and_the_default_stays_the_sites(w: World) -> None:
    """The backend passes the JobSpec's request on to the renderer; a launch that asked for neither is asked for
    the site's [slurm] mem_mb and cpus_per_task, as before."""
    b = w.backend(policy=SbatchPolicy(mem_mb=512, cpus_per_task=2))
    run(lambda: b.submit(w.spec("big", mem_mb=64, cpus=3)))
    assert {"--mem=64M", "--cpus-per-task=3"} <= set(w.fake.last_args("sbatch"))
    run(lambda: b.submit(w.spec("plain")))
    assert {"--mem=512M", "--cpus-per-task=2"} <= set(w.fake.last_args("sbatch"))


def test_sbatch_that_timed_out_after_creating_the_job_is_adopted_not_duplicated(w: World) -> None:
    spec = w.spec("once")
    w.fake.fail_next("sbatch", 1, stderr=TRANSIENT, act=True)
    b = w.backend()
    refs = run(lambda: b.submit(spec))
    (job_id,) = w.jobs()
    assert [r.job_id for r in refs] == [job_id]
    assert w.calls() == {"sbatch": 1, "squeue": 1, "sacct": 0, "scancel": 0}  # the retry looked first
    assert w.sleeps == [2.0]
    rec = b.job_of(spec.key)
    assert rec is not None
    assert rec.adopted


def test_a_job_of_the_same_name_from_another_run_dir_is_not_adopted(w: World) -> None:
    spec = w.spec("reused")
    other = w.run_dir.parent / "old-runs"
    other.mkdir()
    name = f"--job-name=sk-{WS}-1-reused"
    subprocess.run(
        ["sbatch", "--parsable", name, f"--chdir={other}", "--wrap=true"], env=w.fake.env(), check=True
    )
    w.fake.fail_next("sbatch", 1, stderr=TRANSIENT)  # so that the retry looks the name up
    b = w.backend()
    run(lambda: b.submit(spec))
    assert w.calls()["squeue"] == 1
    assert len(w.jobs()) == 2
    rec = b.job_of(spec.key)
    assert rec is not None
    assert not rec.adopted


def test_a_sbatch_that_never_answers_is_timed_out_and_the_job_found_by_name(w: World) -> None:
    spec = w.spec("slowctl")
    w.fake.fail_next("sbatch", 0, act=True, delay=30)
    b = w.backend(submit_timeout_s=0.5)
    t0 = time.monotonic()
    run(lambda: b.submit(spec))
    assert time.monotonic() - t0 < 10
    assert len(w.jobs()) == 1
    assert w.calls()["sbatch"] == 1


def test_transient_failures_are_retried_with_backoff(w: World) -> None:
    spec = w.spec("retry")
    for _ in range(3):
        w.fake.fail_next("sbatch", 1, stderr=TRANSIENT)
    w.fake.fail_next("squeue", 1, stderr=DOWN)  # the lookup before the 2nd sbatch: unknown, so no sbatch
    b = w.backend()
    run(lambda: b.submit(spec))
    assert w.sleeps == [2.0, 4.0, 8.0, 16.0]
    assert w.calls() == {"sbatch": 4, "squeue": 4, "sacct": 0, "scancel": 0}
    assert len(w.jobs()) == 1


def test_refusals_and_exhausted_retries_raise(w: World) -> None:
    bad = w.spec("bad")
    w.fake.fail_next("sbatch", 1, stderr="sbatch: error: Batch job submission failed: Invalid partition name")
    b = w.backend(submit_attempts=3)
    with pytest.raises(S.SlurmRefused, match="Invalid partition name") as refused:
        run(lambda: b.submit(bad))
    assert refused.value.detail == "sbatch: error: Batch job submission failed: Invalid partition name"
    assert w.sleeps == []
    assert not (bad.paths.launch_dir / S.SPEC_FILE).exists(), "a restart must not resubmit a refused launch"
    down = w.spec("down")
    w.fake.fail_next("sbatch", 1, stderr=TRANSIENT)
    for _ in range(2):
        w.fake.fail_next("squeue", 1, stderr=DOWN)
    with pytest.raises(S.SlurmSubmitError, match=r"not submitted after 3 attempts.*Unable to contact"):
        run(lambda: b.submit(down))
    assert w.jobs() == {}
    assert b.open_tasks(bad.key) == b.open_tasks(down.key) == []
    with pytest.raises(BackendUnavailable, match=r"job\.sh is missing"):
        run(lambda: b.submit(w.spec("nojob", write=False)))


# --- tracking ----------------------------------------------------------------------------------------------


def adopt_many(w: World, n: int) -> tuple[S.SlurmBackend, list[JobSpec], list[str]]:
    """n launches recorded in the run dir (as a previous kernel left them), their jobs pending in the fake."""
    ids = w.fake.add_jobs(n)
    specs = []
    for i, job_id in enumerate(ids):
        spec = w.spec(f"j{i}", seq=i, write=False)
        spec.paths.launch_dir.mkdir(parents=True)
        S._write_json(spec.paths.launch_dir, S.SPEC_FILE, spec)
        S._write_json(spec.paths.launch_dir, S.JOB_FILE, S.JobRecord(job_id, f"n{i}", time.time()))
        specs.append(spec)
    return w.backend(), specs, ids


def test_one_squeue_per_cycle_for_a_thousand_jobs_and_sacct_only_for_the_vanished(w: World) -> None:
    b, specs, ids = adopt_many(w, 1000)

    async def go() -> None:
        found = await b.recover(w.run_dir)
        assert len(found.running) == 1000
        assert not found.requeued
        assert w.calls() == {"sbatch": 0, "squeue": 0, "sacct": 0, "scancel": 0}  # ids came from the files
        await b.poll_once()
        assert w.calls()["squeue"] == 1
        assert drain(b) == []
        for job_id in ids[:3]:
            w.fake.set_state(job_id, None, "RUNNING")
        await b.poll_once()
        # The wrapper of job 0 finishes: the next file tick reports it, without asking Slurm.
        jobscript.write_exit(specs[0].task_dir(0), jobscript.ExitRecord(0, "exited"))
        assert await b.check_files() == 1
        assert w.calls() == {"sbatch": 0, "squeue": 2, "sacct": 0, "scancel": 0}
        # Job 1 leaves the queue without an exit file: one sacct (disabled here), then VANISHED.
        w.fake.purge(ids[1])
        await b.poll_once()
        assert w.calls() == {"sbatch": 0, "squeue": 3, "sacct": 1, "scancel": 0}
        # Job 2 too: the backend knows there is no accounting and does not ask again.
        w.fake.purge(ids[2])
        await b.poll_once()
        assert w.calls() == {"sbatch": 0, "squeue": 4, "sacct": 1, "scancel": 0}

    run(go)
    done = drain(b)
    assert [(e.key, e.task) for e in done] == [(specs[i].key, 0) for i in (0, 1, 2)]
    assert state_of(specs[0]).state == "COMPLETED"
    assert (exit_of(specs[1]).code, exit_of(specs[1]).kind) == (jobscript.EXIT_LOST, "vanished")
    assert state_of(specs[1]).state == "VANISHED"
    assert len(b.tracked_jobs) == 997


@pytest.mark.parametrize("accounting", [True])
def test_accounting_explains_what_died_without_an_exit_file(tmp_path: Path, accounting: bool) -> None:
    w = World(tmp_path, accounting=accounting)
    try:
        check_accounting(w)
    finally:
        w.close()


def check_accounting(w: World) -> None:
    b, specs, ids = adopt_many(w, 4)
    cases = [("OUT_OF_MEMORY", "0:125", None), ("NODE_FAIL", "0:0", None), ("CANCELLED", "0:15", 4242)]

    async def go() -> None:
        await b.recover(w.run_dir)
        for job_id in ids:
            w.fake.set_state(job_id, None, "RUNNING")
        await b.poll_once()
        for job_id, (state, code, by) in zip(ids, cases, strict=False):
            w.fake.set_state(job_id, None, state, exit_code=code, cancelled_by=by)
            w.fake.purge(job_id)
        await b.poll_once()

    run(go)
    assert w.calls()["sacct"] == 1
    assert w.calls()["squeue"] == 2
    assert sorted(e.key for e in drain(b)) == sorted(s.key for s in specs[:3])
    kinds = [(exit_of(s).kind, state_of(s).state) for s in specs[:3]]
    assert kinds == [
        ("out_of_memory", "OUT_OF_MEMORY"),
        ("node_fail", "NODE_FAIL"),
        ("cancelled", "CANCELLED"),
    ]
    assert "uid 4242" in (state_of(specs[2]).hint or "")
    assert jobscript.read_exit(specs[3].task_dir(0)) is None  # still running: untouched


def test_controller_failure_reports_nothing_failed_and_backs_off(w: World) -> None:
    b, specs, ids = adopt_many(w, 2)

    async def go() -> None:
        await b.recover(w.run_dir)
        for job_id in ids:
            w.fake.set_state(job_id, None, "RUNNING")
        await b.poll_once()
        floor = b.next_interval()
        for job_id in ids:  # the jobs end (and are purged) while the controller does not answer
            w.fake.purge(job_id)
        for _ in range(3):
            w.fake.fail_next("squeue", 1, stderr=DOWN)
            await b.poll_once()
        assert drain(b) == []
        assert b.next_interval() == min(60.0, floor * 8)
        # A wrapper that finished writes its file: reported although squeue keeps failing.
        jobscript.write_exit(specs[0].task_dir(0), jobscript.ExitRecord(3, "exited"))
        w.fake.fail_next("squeue", 1, stderr=DOWN)
        await b.poll_once()
        assert [e.key for e in drain(b)] == [specs[0].key]
        # A squeue that hangs is cut off by the client timeout: unknown as well.
        b.client_timeout_s = 0.5
        w.fake.fail_next("squeue", 0, delay=20)
        await b.poll_once()
        assert drain(b) == []
        # The controller answers again: the job that left without an exit file is decided now.
        await b.poll_once()
        assert [e.key for e in drain(b)] == [specs[1].key]

    run(go)
    assert state_of(specs[0]).state == "FAILED"
    assert exit_of(specs[1]).kind == "vanished"


def test_a_sigterm_from_the_walltime_reads_timeout_once_slurm_says_so(w: World) -> None:
    b, specs, ids = adopt_many(w, 1)

    async def go() -> None:
        await b.recover(w.run_dir)
        w.fake.set_state(ids[0], None, "RUNNING")
        await b.poll_once()
        # Slurm's SIGTERM at the time limit: the wrapper records `terminated`, Slurm still shows it RUNNING.
        jobscript.write_exit(specs[0].task_dir(0), jobscript.ExitRecord(122, "terminated", signal="SIGTERM"))
        assert await b.check_files() == 0
        await b.poll_once()
        assert drain(b) == []
        # the executor reading the record now learns nothing yet (it would record CANCELLED, the table's reading)
        assert b.outcome_of(specs[0].task_dir(0)) is None
        w.fake.set_state(ids[0], None, "TIMEOUT", exit_code="0:15")
        await b.poll_once()

    run(go)
    assert [e.key for e in drain(b)] == [specs[0].key]
    assert state_of(specs[0]).state == "TIMEOUT"
    out = b.outcome_of(specs[0].task_dir(0))
    assert out is not None
    assert out.state == "TIMEOUT"  # what slurm-state.json says is what the kernel records
    # a backend that does not track the task (a restarted kernel adopts finished tasks as finished) reads the
    # record with whatever the backend recorded, never waits
    other = w.backend()
    assert other.outcome_of(specs[0].task_dir(0)) == out
    assert exit_of(specs[0]).kind == "terminated"  # the wrapper's own record is never rewritten


def test_a_failure_slurm_explains_is_read_with_slurms_state_never_before_it(w: World) -> None:
    """The command was SIGKILLed at the memory limit: the wrapper records `signaled`. Until the backend has
    classified the end, its `outcome_of` says nothing (the executor's sweep would otherwise record FAILED, the
    record's row, racing the backend); once Slurm says OUT_OF_MEMORY, that is what both slurm-state.json and the
    kernel read."""
    b, specs, ids = adopt_many(w, 1)
    tdir = specs[0].task_dir(0)

    async def go() -> None:
        await b.recover(w.run_dir)
        w.fake.set_state(ids[0], None, "RUNNING")
        await b.poll_once()
        jobscript.write_exit(tdir, jobscript.ExitRecord(137, "signaled", signal="SIGKILL"))
        assert b.outcome_of(tdir) is None
        w.fake.set_state(ids[0], None, "OUT_OF_MEMORY", exit_code="0:9")
        await b.poll_once()

    run(go)
    assert [e.key for e in drain(b)] == [specs[0].key]
    out = b.outcome_of(tdir)
    assert out is not None
    assert state_of(specs[0]).state == out.state == "OUT_OF_MEMORY"


def test_exit_grace_waits_for_a_late_exit_file(w: World) -> None:
    b, specs, ids = adopt_many(w, 1)
    b.exit_grace_s = 3600.0

    async def go() -> None:
        await b.recover(w.run_dir)
        w.fake.set_state(ids[0], None, "COMPLETED")
        await b.poll_once()
        assert drain(b) == []
        jobscript.write_exit(specs[0].task_dir(0), jobscript.ExitRecord(0, "exited"))
        await b.poll_once()

    run(go)
    assert [e.key for e in drain(b)] == [specs[0].key]
    assert exit_of(specs[0]).kind == "exited"


def test_a_pending_reason_that_never_clears_is_a_stuck_exit_and_healthy_waits_wake_nothing(w: World) -> None:
    b, specs, ids = adopt_many(w, 2)

    async def go() -> None:
        await b.recover(w.run_dir)
        w.fake.set_state(ids[0], None, "PENDING", reason="Priority")
        w.fake.set_state(ids[1], None, "PENDING", reason="PartitionDown")
        await b.poll_once()

    run(go)
    assert [e.key for e in drain(b)] == [specs[1].key]
    rec = exit_of(specs[1])
    assert rec.kind == S.KIND_STUCK
    assert "PartitionDown" in (rec.detail or "")
    assert w.jobs()[ids[1]]["tasks"]["-"]["state"] == "CANCELLED", (
        "a stuck task is cancelled, never runs late"
    )
    assert w.fake.last_args("scancel") == [ids[1]]
    assert jobscript.read_exit(specs[0].task_dir(0)) is None
    # slurm-state.json and the executor read the end the same way (it said PENDING while the kernel recorded
    # CANCELLED: a second mapping)
    out = b.outcome_of(specs[1].task_dir(0))
    assert out is not None
    assert state_of(specs[1]).state == out.state == "CANCELLED"
    assert b.outcome_of(specs[0].task_dir(0)) is None


# --- cancel and recover ------------------------------------------------------------------------------------


def test_cancel_tasks_then_the_whole_array_and_retry_while_the_controller_is_down(w: World) -> None:
    spec = w.spec("arr", array=3)
    b = w.backend()

    async def go() -> None:
        await b.submit(spec)
        (job_id,) = w.jobs()
        w.fake.set_state(job_id, 0, "RUNNING")
        got = await b.cancel(spec.key, [0, 1])
        assert [r.job_id for r in got] == [f"{job_id}_0", f"{job_id}_1"]
        assert w.fake.last_args("scancel") == [f"{job_id}_0", f"{job_id}_1"]
        await b.poll_once()
        assert sorted(e.task for e in drain(b)) == [0, 1]
        assert b.open_tasks(spec.key) == [2]
        w.fake.fail_next("scancel", 1, stderr="scancel: error: Unable to contact slurm controller")
        assert [r.task for r in await b.cancel(spec.key)] == [2]
        assert w.jobs()[job_id]["tasks"]["2"]["state"] == "PENDING"
        await b.poll_once()  # the loop asks scancel again, then sees the task cancelled
        assert w.fake.last_args("scancel") == [job_id]
        await b.poll_once()
        assert [e.task for e in drain(b)] == [2]
        assert await b.cancel(spec.key) == []
        assert await b.cancel("no/such/launch") == []

    run(go)
    assert w.calls()["scancel"] == 3
    # A restarted kernel still knows it cancelled them (no "cancelled outside the kernel" hint).
    again = w.backend()
    run(lambda: again.recover(w.run_dir))
    assert again._launches[spec.key].cancelled == {0, 1, 2}
    for k in range(3):
        assert (exit_of(spec, k).kind, state_of(spec, k).state) == ("cancelled", "CANCELLED")
        assert state_of(spec, k).hint is None  # the kernel asked: not "outside the kernel"


def test_recover_adopts_by_name_and_resubmits_only_what_slurm_never_saw(w: World) -> None:
    crashed = w.spec("crashed")  # sbatch ran, the kernel died before slurm-job.json
    never = w.spec("never")  # the kernel died before sbatch
    for spec in (crashed, never):
        spec.paths.launch_dir.mkdir(parents=True, exist_ok=True)
        S._write_json(spec.paths.launch_dir, S.SPEC_FILE, spec)
    b0 = w.backend()
    argv = render_sbatch_argv(
        SbatchJob(workspace=WS, seq=1, launch="crashed", minutes=1), b0.policy, crashed.paths
    )
    subprocess.run(argv, env=w.fake.env(), check=True, capture_output=True)
    (crashed_id,) = w.jobs()
    b = w.backend()

    async def go() -> Recovered:
        async with anyio.create_task_group() as tg:
            await tg.start(b.run)
            found = await b.recover(w.run_dir)
            await wait_for(lambda: b.job_of(never.key) is not None)
            tg.cancel_scope.cancel()
        return found

    found = run(go)
    assert [r.key for r in found.running] == [crashed.key]
    assert [r.job_id for r in found.running] == [crashed_id]
    assert [r.key for r in found.requeued] == [never.key]
    assert len(w.jobs()) == 2
    assert w.calls()["sbatch"] == 2  # the hand-made one, then `never` once


def test_recover_names_the_job_of_a_launch_that_ended_while_the_kernel_was_down(w: World) -> None:
    """sbatch ran, the kernel died before slurm-job.json, and the job finished before the restart."""
    spec = w.spec("quick")
    spec.paths.launch_dir.mkdir(parents=True, exist_ok=True)
    S._write_json(spec.paths.launch_dir, S.SPEC_FILE, spec)
    b0 = w.backend()
    argv = render_sbatch_argv(
        SbatchJob(workspace=WS, seq=1, launch="quick", minutes=1), b0.policy, spec.paths
    )
    subprocess.run(argv, env=w.fake.env(), check=True, capture_output=True)
    (job_id,) = w.jobs()
    jobscript.write_exit(spec.task_dir(0), jobscript.ExitRecord(0, "exited"))
    b = w.backend()

    async def go() -> Recovered:
        async with anyio.create_task_group() as tg:
            await tg.start(b.run)
            found = await b.recover(w.run_dir)
            tg.cancel_scope.cancel()
        return found

    found = run(go)
    assert [(r.key, r.job_id) for r in found.finished] == [(spec.key, job_id)]
    assert not found.running
    assert not found.requeued
    rec = msgspec.json.decode((spec.paths.launch_dir / S.JOB_FILE).read_bytes(), type=S.JobRecord)
    assert (rec.job_id, rec.adopted) == (job_id, True)
    assert w.calls()["sbatch"] == 1  # nothing resubmitted


def test_every_slurm_config_key_reaches_the_backend_built_by_make_backend() -> None:
    cfg = parse(
        'backend = "slurm"\n[slurm]\npartition = "gpu"\naccount = "lab"\nqos = "long"\n'
        'constraint = "a100&ib"\nextra_args = ["--reservation=r"]\nmem_mb = 2000\nmem_per_gpu_mb = 500\n'
        'cpus_per_task = 2\ncpus_per_gpu = 6\ngpu_flag = "gpus-per-task"\ngpu_type = "a100"\nnice = 7\n'
        "setup_slack_minutes = 3\nwarn_seconds = 90\npoll_seconds = 4\npoll_max_seconds = 40\n"
        "client_timeout_seconds = 11\nsubmit_timeout_seconds = 22\nsubmit_attempts = 3\n"
        "exit_grace_seconds = 5\nfile_poll_seconds = 0.5\nrequeues = true\n",
        "site.toml",
    )
    b = make_backend(cfg)
    assert isinstance(b, S.SlurmBackend)
    assert b.policy == SbatchPolicy(
        partition="gpu",
        account="lab",
        qos="long",
        constraint="a100&ib",
        extra_args=("--reservation=r",),
        mem_mb=2000,
        mem_per_gpu_mb=500,
        cpus_per_task=2,
        cpus_per_gpu=6,
        gpu_flag="gpus-per-task",
        gpu_type="a100",
        nice=7,
        setup_slack_minutes=3,
        warn_seconds=90,
    )
    assert (b.poll_floor_s, b.poll_ceiling_s, b.client_timeout_s, b.submit_timeout_s) == (4, 40, 11, 22)
    assert (b.submit_attempts, b.exit_grace_s, b.file_poll_s, b.requeues) == (3, 5, 0.5, True)
    b.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('partition = "a b"', "key 'slurm.partition' expected `str` matching regex"),
        ("mem_mb = 0", "key 'slurm.mem_mb' expected `int` >= 1"),
        ('gpu_flag = "gpus"', "key 'slurm.gpu_flag' invalid enum value 'gpus'"),
        ('extra_args = ["x"]', "key 'slurm.extra_args.0' expected `str` matching regex"),
        ("warn_seconds = 400", "key 'slurm' warn_seconds (400) is above setup_slack_minutes * 60 (300)"),
        ("poll_seconds = 90", "key 'slurm' poll_max_seconds (60) is below poll_seconds (90)"),
        ("setup_slack_minutes = 0", "key 'slurm.setup_slack_minutes' expected `int` >= 1"),
        ("submit_attempts = 0", "key 'slurm.submit_attempts' expected `int` >= 1"),
        ("poll = 3", "key 'slurm.poll' is not a known setting"),
    ],
)
def test_bad_slurm_config_keys_are_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(f"[slurm]\n{text}\n", "site.toml")
    assert str(e.value).startswith(f"site.toml: {message}"), str(e.value)


def test_policy_from_config_and_exit_state_mapping() -> None:
    cfg = SlurmConfig(partition="gpu", account="lab", extra_args=("--reservation=r",), poll_seconds=20)
    pol = S.policy_from_config(cfg, mem_mb=2048)
    assert (pol.partition, pol.account, pol.extra_args, pol.mem_mb) == (
        "gpu",
        "lab",
        ("--reservation=r",),
        2048,
    )
    b = S.SlurmBackend.from_config(cfg, env={"PATH": "/x", "SECRET": "s", "SLURM_CONF": "/c"})
    assert (b.poll_floor_s, b.poll_ceiling_s, b.submit_timeout_s) == (20, 60, 60.0)
    assert b.env == {"PATH": "/x", "LANG": "C.UTF-8", "SLURM_CONF": "/c"}, "kernel env must not reach jobs"
    b.close()
    rec = jobscript.ExitRecord
    assert S.outcome_with(rec(123, "timeout"), None).state == "TIMEOUT"
    assert S.outcome_with(rec(122, "terminated"), None).state == "CANCELLED"
    assert S.outcome_with(rec(0, "exited"), None).state == "COMPLETED"
    assert S.outcome_with(rec(137, "signaled"), None).state == "FAILED"
    assert S.outcome_with(rec(137, "signaled"), "OUT_OF_MEMORY").state == "OUT_OF_MEMORY"
    assert S.outcome_with(rec(125, "node_fail"), None).state == "NODE_FAIL"


def test_jobs_on_a_named_cluster_are_polled_and_cancelled_with_M(tmp_path: Path) -> None:
    w = World(tmp_path, cluster="c2")
    try:
        spec = w.spec("far", array=2)
        b = w.backend()

        async def go() -> None:
            await b.submit(spec)
            job = b.job_of(spec.key)
            assert job is not None
            assert job.cluster == "c2"
            await b.poll_once()
            assert w.fake.last_args("squeue")[:2] == ["-M", "c2"]
            await b.cancel(spec.key)
            assert w.fake.last_args("scancel") == ["-M", "c2", job.job_id]
            await b.poll_once()
            assert sorted(e.task for e in drain(b)) == [0, 1]

        run(go)
        assert w.calls()["squeue"] == 2
    finally:
        w.close()


def test_hint_of_a_sigterm_the_kernel_did_not_send_before_slurm_explains_it(w: World) -> None:
    spec = w.spec("arr", array=2)
    b = w.backend()

    async def go() -> None:
        await b.submit(spec)
        await b.cancel(spec.key, [1])

    run(go)
    term = jobscript.ExitRecord(jobscript.EXIT_TERMINATED, "terminated")
    for t in (0, 1):
        jobscript.write_exit(spec.task_dir(t), term)
    assert S.hint_of(spec.task_dir(0)) == S.OUTSIDE_HINT  # nobody in the kernel asked for it
    assert S.hint_of(spec.task_dir(1)) is None  # the kernel's own cancel
    S._write_json(spec.task_dir(0), S.STATE_FILE, S.TaskSlurmState("9_0", "CANCELLED", "cancelled by uid 7"))
    assert S.hint_of(spec.task_dir(0)) == "cancelled by uid 7"  # Slurm's word, once the backend has it
    other = w.spec("local", write=False)
    other.task_dir(0).mkdir(parents=True)
    jobscript.write_exit(other.task_dir(0), term)
    assert S.hint_of(other.task_dir(0)) is None  # not a task this backend submitted


@pytest.mark.parametrize(
    ("res", "stuck", "state"),
    [
        (Resolution("done", "OUT_OF_MEMORY", exit_code=0, signal=125), False, "OUT_OF_MEMORY"),
        (Resolution("done", "NODE_FAIL", "the node failed"), False, "NODE_FAIL"),
        (Resolution("done", "PREEMPTED", "preempted"), False, "PREEMPTED"),
        (Resolution("done", "VANISHED", "gone without a record"), False, "VANISHED"),
        (Resolution("done", "TIMEOUT"), False, "TIMEOUT"),
        (Resolution("done", "CANCELLED", "cancelled by uid 7"), False, "CANCELLED"),
        (Resolution("done", "FAILED", "killed by signal 9", exit_code=0, signal=9), False, "FAILED"),
        (Resolution("stuck", "PENDING", "PartitionDown: the partition is down"), True, "CANCELLED"),
    ],
)
def test_the_wake_reads_every_exit_record_the_backend_writes(
    tmp_path: Path, res: Resolution, stuck: bool, state: str
) -> None:
    """What the executor records (kernel.service.gather.outcome, lifecycle-checked) for a task Slurm ended without the
    wrapper's record, and the hint the wake then shows: the backend's own when it has one."""
    rec = S.exit_record_for(res, stuck=stuck)
    out = gather.outcome(rec)
    assert out.state == state
    assert next_task_state("RUNNING", out.event, out.state) == state
    S._write_json(
        tmp_path, S.STATE_FILE, S.TaskSlurmState("5", S.outcome_with(rec, res.state).state, res.hint)
    )
    jobscript.write_exit(tmp_path, rec)
    assert gather.backend_hint(tmp_path, S.hint_of) == res.hint
    assert S.outcome_of(tmp_path) == out  # the backend's reading is the one the table gives


def test_recover_before_run_as_the_service_calls_them_resubmits_once_run_starts(w: World) -> None:
    """A launch with slurm.json but no job (sbatch retries ran out, or the kernel died before sbatch): the
    service calls recover() before run(); the restart must not fail, and the launch is submitted once run()
    starts."""
    never = w.spec("never")
    never.paths.launch_dir.mkdir(parents=True, exist_ok=True)
    S._write_json(never.paths.launch_dir, S.SPEC_FILE, never)
    b = w.backend()

    async def go() -> Recovered:
        found = await b.recover(w.run_dir)  # no loop yet
        async with anyio.create_task_group() as tg:
            await tg.start(b.run)
            await wait_for(lambda: b.job_of(never.key) is not None)
            tg.cancel_scope.cancel()
        return found

    found = run(go)
    assert [r.key for r in found.requeued] == [never.key]
    assert w.calls()["sbatch"] == 1


def test_ends_written_on_a_full_run_directory_disk_are_held_not_raised(tmp_path: Path) -> None:
    w = World(tmp_path, accounting=True)
    try:
        with tmpfs(w.run_dir, "4m"):
            check_full_disk(w)
    finally:
        w.close()


def check_full_disk(w: World) -> None:
    b, specs, ids = adopt_many(w, 2)
    fill(w.run_dir / "filler")

    async def go() -> None:
        await b.recover(w.run_dir)
        for job_id in ids:
            w.fake.set_state(job_id, None, "RUNNING")
        await b.poll_once()
        for job_id, state in zip(ids, ("OUT_OF_MEMORY", "NODE_FAIL"), strict=True):
            w.fake.set_state(job_id, None, state, exit_code="0:125" if state == "OUT_OF_MEMORY" else "0:0")
            w.fake.purge(job_id)
        await b.poll_once()  # each end's record cannot be written: held, the poll goes on

    run(go)
    assert sorted(e.key for e in drain(b)) == sorted(s.key for s in specs)
    for spec, state in zip(specs, ("OUT_OF_MEMORY", "NODE_FAIL"), strict=True):
        assert jobscript.read_exit(spec.task_dir(0)) is None
        out = b.outcome_of(spec.task_dir(0))
        assert out is not None
        assert out.state == state  # Slurm's account of the end stays the end
