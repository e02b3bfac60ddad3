"""Table tests for the sbatch argv, job names and the reading of `sbatch --parsable`."""

from __future__ import annotations

from pathlib import Path

import pytest

from channel.paths import RunPaths, workspace_key
from kernel.backends.slurm import (
    SbatchJob,
    SbatchPolicy,
    SlurmOutputError,
    Submitted,
    job_comment,
    job_name,
    parse_job_name,
    parse_sbatch_output,
    render_sbatch_argv,
    sbatch_failure,
)

WS = workspace_key("/home/a/proj")
RUN = Path("/srv/kernel/run")


def _paths(launch: str = "train", seq: int = 7) -> RunPaths:
    return RunPaths(RUN, WS, seq, launch)


def _job(**kw: object) -> SbatchJob:
    fields: dict[str, object] = {"workspace": WS, "seq": 7, "launch": "train", "minutes": 30}
    fields.update(kw)
    return SbatchJob(**fields)  # type: ignore[arg-type]


def _flags(argv: list[str]) -> dict[str, str]:
    return {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else "" for a in argv[1:-1]}


def test_single_job_argv_in_full() -> None:
    sleep = RUN / WS / "7"
    assert render_sbatch_argv(_job(), SbatchPolicy(), _paths()) == [
        "sbatch",
        "--parsable",
        f"--job-name=sk-{WS}-7-train",
        f"--comment=syscall-kernel ws={WS} seq=7 launch=train",
        f"--chdir={sleep}/train",
        f"--output={sleep}/train/scheduler.out",
        f"--error={sleep}/train/scheduler.out",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=1",
        "--mem=4096M",
        "--time=35",
        "--signal=B:USR2@120",
        "--kill-on-invalid-dep=yes",
        f"{sleep}/train/job.sh",
    ]


@pytest.mark.parametrize(
    ("array", "concurrency", "expected"),
    [
        (1, 0, None),
        (1, 3, None),
        (4, 0, "0-3"),
        (4, 2, "0-3%2"),
        (4, 4, "0-3"),
        (4, 9, "0-3"),
        (16, 1, "0-15%1"),
    ],
)
def test_array_and_throttle(array: int, concurrency: int, expected: str | None) -> None:
    flags = _flags(render_sbatch_argv(_job(array=array, concurrency=concurrency), SbatchPolicy(), _paths()))
    assert flags.get("--array") == expected


def test_a_sleeps_gpu_launches_are_throttled_to_their_share_of_the_ceiling() -> None:
    """Cap 8 and two `--gpus 4 --array 8` launches (each sized alone: `%2`, 16 GPUs at once): the widths decided
    at acceptance reach sbatch as `%1` each; a CPU launch beside them is not throttled."""
    from channel.messages import Launch, Policy, SleepRequest
    from channel.safefs import Identity
    from kernel.core.budget import Balance
    from kernel.core.records import WorkspaceRow
    from kernel.core.rules import accept_sleep, array_throttle

    now = "2026-12-03T12:00:00.000Z"
    policy = Policy(max_gpus=4, max_concurrent_gpus=8)
    ws = WorkspaceRow(WS, "/w", Identity(1, 2, 3), Balance(10, 5, 10**9), policy, "sha", "inotify", now, None)
    req = SleepRequest(
        protocol=1,
        id="s1",
        launches=(
            Launch(name="a", command="x", gpus=4, array=8),
            Launch(name="b", command="x", gpus=4, array=8),
            Launch(name="c", command="x", array=3),
        ),
    )
    firsts = {j.launch: j for j in reversed(accept_sleep(ws, (), req, 7, now).jobs)}
    arrays = {}
    for name, j in firsts.items():
        job = _job(launch=name, gpus=j.gpus, array=j.array_size, concurrency=array_throttle(j, 8))
        arrays[name] = _flags(render_sbatch_argv(job, SbatchPolicy(), _paths(name))).get("--array")
    assert arrays == {"a": "0-7%1", "b": "0-7%1", "c": "0-2"}


def test_array_output_uses_the_task_index_pattern() -> None:
    flags = _flags(render_sbatch_argv(_job(array=3), SbatchPolicy(), _paths()))
    assert flags["--output"] == f"{RUN}/{WS}/7/train.%a/scheduler.out"
    assert flags["--error"] == flags["--output"]
    # The pattern expands to RunPaths' own task directory for each index.
    assert flags["--output"].replace("%a", "2") == str(_paths().task_file(2, 3, "scheduler.out"))


@pytest.mark.parametrize(
    ("policy", "gpus", "expected"),
    [
        (SbatchPolicy(), 2, {"--gres": "gpu:2"}),
        (SbatchPolicy(gpu_type="a100"), 1, {"--gres": "gpu:a100:1"}),
        (SbatchPolicy(gpu_flag="gpus-per-task"), 4, {"--gpus-per-task": "4"}),
        (SbatchPolicy(gpu_flag="gpus-per-task", gpu_type="h100"), 2, {"--gpus-per-task": "h100:2"}),
        (SbatchPolicy(), 0, {}),
    ],
)
def test_gpu_flags(policy: SbatchPolicy, gpus: int, expected: dict[str, str]) -> None:
    flags = _flags(render_sbatch_argv(_job(gpus=gpus), policy, _paths()))
    got = {k: v for k, v in flags.items() if k in ("--gres", "--gpus-per-task")}
    assert got == expected


def test_policy_fields_become_flags() -> None:
    policy = SbatchPolicy(
        partition="gpu,gpu-long",
        account="proj-42",
        qos="normal",
        constraint="a100&ib",
        nice=50,
        cpus_per_task=2,
        cpus_per_gpu=8,
        mem_mb=8000,
        mem_per_gpu_mb=32000,
        setup_slack_minutes=10,
        warn_seconds=300,
        extra_args=("--reservation=maint",),
    )
    argv = render_sbatch_argv(_job(gpus=2, minutes=60), policy, _paths())
    flags = _flags(argv)
    assert flags["--partition"] == "gpu,gpu-long"
    assert flags["--account"] == "proj-42"
    assert flags["--qos"] == "normal"
    assert flags["--constraint"] == "a100&ib"
    assert flags["--nice"] == "50"
    assert flags["--cpus-per-task"] == "16"  # 2 GPUs x 8 CPUs beats the floor of 2
    assert flags["--mem"] == "72000M"  # integers only: 8000 + 2 x 32000
    assert flags["--time"] == "70"
    assert flags["--signal"] == "B:USR2@300"
    assert argv[-2] == "--reservation=maint"
    assert argv[-1].endswith("/job.sh")


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (SbatchPolicy(partition="gpu queue"), "partition"),
        (SbatchPolicy(account="a;rm -rf"), "account"),
        (SbatchPolicy(qos="x y"), "qos"),
        (SbatchPolicy(gpu_type="a100 "), "gpu_type"),
        (SbatchPolicy(constraint="a b"), "constraint"),
    ],
)
def test_bad_policy_words_are_refused(policy: SbatchPolicy, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render_sbatch_argv(_job(), policy, _paths())


@pytest.mark.parametrize(
    ("job", "paths", "message"),
    [
        (_job(minutes=0), _paths(), "minutes=0"),
        (_job(array=0), _paths(), "array=0"),
        (_job(array=2000), _paths(), "MaxArraySize"),
        (_job(concurrency=-1), _paths(), "concurrency=-1"),
        (_job(), _paths(seq=8), "do not belong"),
        (_job(launch="Bad_Name"), RunPaths(RUN, WS, 7, "Bad_Name"), "launch name"),
        (_job(), RunPaths(Path("/srv/100%/run"), WS, 7, "train"), "filename pattern"),
        (_job(), RunPaths(Path("relative/run"), WS, 7, "train"), "absolute"),
    ],
)
def test_bad_jobs_are_refused(job: SbatchJob, paths: RunPaths, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render_sbatch_argv(job, SbatchPolicy(), paths)


def test_job_name_round_trips_and_is_unique_per_launch() -> None:
    names = {job_name(WS, seq, launch) for seq in (0, 1, 12) for launch in ("a", "a-1", "train-2")}
    assert len(names) == 9
    for seq in (0, 1, 12):
        for launch in ("a", "a-1", "train-2"):
            assert parse_job_name(job_name(WS, seq, launch)) == (WS, seq, launch)


def test_job_name_of_a_workspace_whose_name_looks_like_a_key() -> None:
    ws = workspace_key("/x/deadbeef00-3-a")
    assert parse_job_name(job_name(ws, 5, "b")) == (ws, 5, "b")


@pytest.mark.parametrize("name", ["wrap", "sk-", "sk-ws-1-a", f"sk-{WS}-x-a", f"sk-{WS}-1-", f"xx-{WS}-1-a"])
def test_parse_job_name_ignores_other_jobs(name: str) -> None:
    assert parse_job_name(name) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("has space", 1, "a"), "workspace key"),
        ((WS, -1, "a"), "seq"),
        ((WS, 1, "A"), "launch name"),
    ],
)
def test_job_name_refuses_bad_parts(args: tuple[str, int, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        job_name(*args)


@pytest.mark.parametrize(
    ("stdout", "expected"),
    [
        ("1234\n", Submitted("1234")),
        ("1234", Submitted("1234")),
        ("1234;cluster-a\n", Submitted("1234", "cluster-a")),
        ("Welcome to the cluster!\nQuota: 10 TB\n\n98765\n", Submitted("98765")),
        ("sbatch: Warning: --mem is ignored\n42;west\n  \n", Submitted("42", "west")),
        ("   77  \n", Submitted("77")),
    ],
)
def test_parse_sbatch_output(stdout: str, expected: Submitted) -> None:
    assert parse_sbatch_output(stdout) == expected


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        ("", "printed nothing"),
        ("\n \n", "printed nothing"),
        ("Submitted batch job 1234\n", "Submitted batch job 1234"),
        ("1234\nplease read the motd\n", "please read the motd"),
        ("12a4\n", "12a4"),
        (";cluster\n", ";cluster"),
        ("-5\n", "-5"),
    ],
)
def test_parse_sbatch_output_refuses_what_is_not_an_id(stdout: str, message: str) -> None:
    with pytest.raises(SlurmOutputError, match=message):
        parse_sbatch_output(stdout)


@pytest.mark.parametrize(
    ("rc", "stderr", "kind"),
    [
        (1, "sbatch: error: Batch job submission failed: Invalid partition name specified", "refused"),
        (
            1,
            "sbatch: error: Batch job submission failed: Invalid account or account/partition combination",
            "refused",
        ),
        (1, "sbatch: error: Batch job submission failed: Invalid qos specification", "refused"),
        (1, "sbatch: error: Invalid generic resource (gres) specification", "refused"),
        (
            1,
            "sbatch: error: Batch job submission failed: Requested node configuration is not available",
            "refused",
        ),
        (
            1,
            "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation",
            "transient",
        ),
        (
            1,
            "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
            "transient",
        ),
        (1, "sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying", "transient"),
        (
            1,
            "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)",
            "transient",
        ),
        (None, "sbatch did not answer within 60 s", "transient"),
    ],
)
def test_sbatch_failure_tells_refusals_from_transient_failures(
    rc: int | None, stderr: str, kind: str
) -> None:
    assert sbatch_failure(rc, stderr) == kind


def test_the_comment_carries_the_workspace_and_the_sleep() -> None:
    flags = _flags(render_sbatch_argv(_job(sleep_id="s-42"), SbatchPolicy(), _paths()))
    assert flags["--comment"] == f"syscall-kernel ws={WS} sleep=s-42 seq=7 launch=train"
    assert job_comment(WS, 7, "train", "s-42") == flags["--comment"]


def test_the_workspace_account_beats_the_sites_and_the_wckey_is_the_sites() -> None:
    site = SbatchPolicy(account="site", wckey="agents")
    flags = _flags(render_sbatch_argv(_job(), site, _paths()))
    assert (flags["--account"], flags["--wckey"]) == ("site", "agents")
    flags = _flags(render_sbatch_argv(_job(account="proj-1"), site, _paths()))
    assert (flags["--account"], flags["--wckey"]) == ("proj-1", "agents")
    flags = _flags(render_sbatch_argv(_job(account="proj-1"), SbatchPolicy(), _paths()))
    assert flags["--account"] == "proj-1"
    assert "--wckey" not in flags


@pytest.mark.parametrize(
    ("job", "policy", "message"),
    [
        (_job(sleep_id="S 1;x"), SbatchPolicy(), "sleep id"),
        (_job(sleep_id=""), SbatchPolicy(), "sleep id"),
        (_job(account="a b"), SbatchPolicy(), "workspace account"),
        (_job(account="a\nb"), SbatchPolicy(), "workspace account"),
        (_job(), SbatchPolicy(wckey="w k"), "wckey"),
    ],
)
def test_bad_attribution_is_refused(job: SbatchJob, policy: SbatchPolicy, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render_sbatch_argv(job, policy, _paths())


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        # Neither asked: the site's default, as before (the floor, or per GPU).
        ({}, {"--mem": "72000M", "--cpus-per-task": "16"}),
        # What the launch asked is what the task gets, GPUs or not.
        ({"mem_mb": 64}, {"--mem": "64M", "--cpus-per-task": "16"}),
        ({"cpus": 3}, {"--mem": "72000M", "--cpus-per-task": "3"}),
        ({"mem_mb": 200000, "cpus": 48}, {"--mem": "200000M", "--cpus-per-task": "48"}),
    ],
)
def test_a_launchs_own_memory_and_cpus_are_what_slurm_is_asked_for(
    asked: dict[str, int], expected: dict[str, str]
) -> None:
    policy = SbatchPolicy(cpus_per_task=2, cpus_per_gpu=8, mem_mb=8000, mem_per_gpu_mb=32000)
    argv = render_sbatch_argv(_job(gpus=2, **asked), policy, _paths())
    flags = _flags(argv)
    assert {k: flags[k] for k in expected} == expected
    assert sum(a.startswith(("--mem=", "--cpus-per-task=")) for a in argv) == 2


@pytest.mark.parametrize("asked", [{"mem_mb": 0}, {"cpus": 0}, {"cpus": -1}])
def test_a_directly_built_job_asking_for_no_memory_or_cpus_is_refused(asked: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="bad job sizes"):
        render_sbatch_argv(_job(**asked), SbatchPolicy(), _paths())
