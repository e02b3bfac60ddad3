"""The fake Slurm (tests/fakes/fake_slurm.py) run as real processes on PATH, read through kernel.backends.slurm's parsers."""

from __future__ import annotations

import os
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from fakes.fake_slurm import FakeSlurm

from channel.paths import RunPaths
from kernel.backends.slurm import (
    SbatchJob,
    SbatchPolicy,
    SqueueResult,
    parse_sbatch_output,
    read_sacct,
    read_squeue,
    render_sbatch_argv,
    resolve_task,
    sacct_argv,
    squeue_argv,
)


def _run(fake: FakeSlurm, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=fake.env(), capture_output=True, text=True, timeout=30, check=False)


def _submit(fake: FakeSlurm, tmp_path: Path, launch: str, array: int = 1, concurrency: int = 0) -> str:
    paths = RunPaths(tmp_path / "run", "ws-0123456789", 1, launch)
    paths.launch_dir.mkdir(parents=True, exist_ok=True)
    (paths.launch_dir / paths.JOB_SCRIPT).write_text("#!/bin/sh\ntrue\n")
    job = SbatchJob(
        workspace="ws-0123456789", seq=1, launch=launch, minutes=5, array=array, concurrency=concurrency
    )
    out = _run(fake, render_sbatch_argv(job, SbatchPolicy(), paths))
    assert out.returncode == 0, out.stderr
    return parse_sbatch_output(out.stdout).job_id


def _squeue(fake: FakeSlurm, ids: list[str]) -> SqueueResult:
    out = _run(fake, squeue_argv(ids))
    return read_squeue(out.returncode, out.stdout, out.stderr, ids)


def test_submit_track_cancel_and_count(tmp_path: Path) -> None:
    fake = FakeSlurm(tmp_path, banner="Welcome to the fake cluster", cluster="west")
    array = _submit(fake, tmp_path, "sweep", array=4, concurrency=2)
    single = _submit(fake, tmp_path, "one")
    assert (array, single) == ("100", "101")

    q = _squeue(fake, [array, single])
    assert q.known
    assert set(q.entries) == {("100", 0), ("100", 1), ("100", 2), ("100", 3), ("101", None)}
    assert {e.state for e in q.entries.values()} == {"PENDING"}

    fake.set_state(array, 0, "RUNNING")
    fake.set_state(array, 1, "COMPLETED")
    fake.set_state(single, None, "TIMEOUT", exit_code="0:15", reason="TimeLimit")
    q = _squeue(fake, [array, single])
    assert q.entries[("100", 0)].state == "RUNNING"
    assert q.entries[("100", 0)].job_id != "100"  # split off with its own id, as in Slurm
    assert resolve_task(("101", None), exit_code=None, queue=q).state == "TIMEOUT"

    out = _run(fake, ["scancel", array])
    assert out.returncode == 0
    q = _squeue(fake, [array, single])
    assert {q.entries[("100", k)].state for k in (0, 2, 3)} == {"CANCELLED"}
    assert q.entries[("100", 1)].state == "COMPLETED"

    out = _run(fake, sacct_argv([array], datetime.now()))
    acct = read_sacct(out.returncode, out.stdout, out.stderr)
    assert acct.status == "disabled"
    assert fake.calls() == {"sbatch": 2, "squeue": 3, "sacct": 1, "scancel": 1}


def test_sacct_with_accounting(tmp_path: Path) -> None:
    fake = FakeSlurm(tmp_path, accounting=True)
    job = _submit(fake, tmp_path, "a", array=2)
    fake.set_state(job, 0, "OUT_OF_MEMORY", exit_code="0:125")
    assert _run(fake, ["scancel", f"{job}_1"]).returncode == 0
    fake.purge(job)
    q = _squeue(fake, [job])
    assert q.known
    assert q.entries == {}  # the single-id pitfall: one purged id exits 1, read as gone
    out = _run(fake, sacct_argv([job], datetime.now()))
    acct = read_sacct(out.returncode, out.stdout, out.stderr)
    assert acct.status == "ok"
    assert (acct.entries[(job, 0)].state, acct.entries[(job, 0)].signal) == ("OUT_OF_MEMORY", 125)
    assert acct.entries[(job, 1)].cancelled_by == os.getuid()
    r = resolve_task((job, 1), exit_code=None, queue=q, accounting=acct, our_uid=os.getuid())
    assert (r.state, r.hint) == (
        "CANCELLED",
        f"cancelled with scancel outside the kernel (uid {os.getuid()})",
    )


def test_unknown_ids(tmp_path: Path) -> None:
    fake = FakeSlurm(tmp_path)
    one = _run(fake, squeue_argv(["999"]))
    assert (one.returncode, "Invalid job id" in one.stderr) == (1, True)
    two = _run(fake, squeue_argv(["998", "999"]))
    assert (two.returncode, two.stdout) == (0, "")
    assert read_squeue(two.returncode, two.stdout, two.stderr, ["998", "999"]).known


def test_injected_failures(tmp_path: Path) -> None:
    fake = FakeSlurm(tmp_path)
    job = _submit(fake, tmp_path, "a")
    fake.fail_next(
        "squeue", 1, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
    )
    assert not _squeue(fake, [job]).known
    assert _squeue(fake, [job]).known

    # sbatch timed out after Slurm created the job: the job exists and is found by its name.
    fake.fail_next("sbatch", 1, "sbatch: error: Batch job submission failed: Socket timed out\n", act=True)
    paths = RunPaths(tmp_path / "run", "ws-0123456789", 1, "b")
    paths.launch_dir.mkdir(parents=True)
    (paths.launch_dir / paths.JOB_SCRIPT).write_text("#!/bin/sh\n")
    argv = render_sbatch_argv(
        SbatchJob(workspace="ws-0123456789", seq=1, launch="b", minutes=1), SbatchPolicy(), paths
    )
    assert _run(fake, argv).returncode == 1
    found = _run(fake, ["squeue", "-h", "--me", "-o", "%i", "--name=sk-ws-0123456789-1-b"])
    assert found.stdout.split() == ["101"]


def test_sbatch_refuses_a_missing_script(tmp_path: Path) -> None:
    fake = FakeSlurm(tmp_path)
    out = _run(fake, ["sbatch", "--parsable", str(tmp_path / "nope.sh")])
    assert out.returncode == 1
    assert "Unable to open file" in out.stderr


@pytest.mark.parametrize("count", [10, 1000])
def test_many_jobs_one_squeue(tmp_path: Path, count: int) -> None:
    fake = FakeSlurm(tmp_path)
    ids = fake.add_jobs(count)
    q = _squeue(fake, ids)
    assert len(q.entries) == count
    assert fake.calls()["squeue"] == 1
