"""End to end on the Slurm backend: the installed tool, a real kernel process, the throwaway cluster, bwrap.

The same executor as on the local backend, with `backend = "slurm"` in the config. To keep the module lean, one
kernel serves every scenario that can share it (each scenario has its own workspace, enrolled before the kernel
starts), and the one slow scenario, a walltime kill (about 60-90 s: Slurm sends the warning with a resolution of
up to a minute), runs in the background from the start while the others go through: a sweep with concurrency 2
(throttled by Slurm itself: `--array=0-3%2`) beside a failing launch, a cancel, a job killed by `scancel` outside
the kernel, a sleep Slurm refuses for good, and slurmctld stopped for 30 s while jobs run. A second kernel is
SIGKILLed between `sbatch` and recording the job id (the TEST ONLY crash hook), then restarted: no duplicate job.

The module needs the throwaway cluster that `./dev test` starts (`scripts/slurm-cluster`): its directory, the
parent of SLURM_CONF, is what `ctl-stop` / `ctl-start` act on.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kernelproc import ROOT, Kernel, make_workspace, put_request, read_answer, run_tool, wait_for, wake_md

from channel.paths import RunPaths, workspace_key
from kernel.backends.slurm import backend as S
from kernel.backends.slurm import job_name
from kernel.io.crash import CRASH_ENV

pytestmark = [pytest.mark.slurm, pytest.mark.bwrap]

SCENARIOS = ("walltime", "sweep", "cancel", "outside", "refused", "outage", "sized")
CONFIG = """backend = "slurm"
jail = "bwrap"
rescan_seconds = 2
[slurm]
poll_seconds = 1.0
poll_max_seconds = 2.0
setup_slack_minutes = 1
warn_seconds = 60
exit_grace_seconds = 2
client_timeout_seconds = 10
"""
OUTAGE_S = 30.0
GPU_HOURS = 4.0


def slurm(conf: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLURM_CONF": str(conf)}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)


def jobs_named(conf: Path, prefix: str) -> dict[str, set[str]]:
    """Our Slurm jobs (live and recently ended) whose name starts with `prefix`: name -> job ids."""
    out = slurm(conf, "squeue", "-h", "-t", "all", "--me", "-o", "%j|%F")
    assert out.returncode == 0, out.stderr
    found: dict[str, set[str]] = {}
    for line in out.stdout.split():
        name, _, job = line.partition("|")
        if name.startswith(prefix):
            found.setdefault(name, set()).add(job)
    return found


def cluster_ctl(conf: Path, verb: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "slurm-cluster"), verb, str(conf.parent)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"slurm-cluster {verb}: {done.stdout}{done.stderr}"


def wait_output(task_dir: Path, text: str, timeout: float = 60) -> None:
    """Wait until the task's command has printed `text` (it runs: `started` alone precedes the jail's setup)."""

    def printed() -> bool:
        try:
            return (task_dir / RunPaths.STDOUT).read_text() == text
        except FileNotFoundError:
            return False

    wait_for(printed, timeout, f"{text!r} on the stdout of {task_dir.name}", step=0.05)


class Env:
    def __init__(
        self, kernel: Kernel, spaces: dict[str, Path], conf: Path, notify: socket.socket, metrics_port: int
    ) -> None:
        self.kernel = kernel
        self.spaces = spaces
        self.conf = conf
        self.notify = notify
        self.metrics_port = metrics_port
        self.statuses: list[str] = []  # every STATUS= the kernel sent, oldest first

    def status_lines(self) -> list[str]:
        """Every STATUS= line the kernel has sent so far."""
        while True:
            try:
                msg = self.notify.recv(65536).decode()
            except BlockingIOError:
                return self.statuses
            self.statuses += [x[len("STATUS=") :] for x in msg.splitlines() if x.startswith("STATUS=")]

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        [value] = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
        return float(value)

    def key(self, name: str) -> str:
        return workspace_key(self.spaces[name].resolve())

    def task_dir(self, name: str, seq: int, launch: str, task: int = 0, array: int = 1) -> Path:
        return RunPaths(self.kernel.state / "runs", self.key(name), seq, launch).task_dir(task, array)

    def tool(self, name: str, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
        return run_tool(self.spaces[name], *args, timeout=timeout + 30)

    def ok(self, name: str, *args: str, timeout: float = 150) -> str:
        done = self.tool(name, *args, timeout=timeout)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
        return done.stdout

    def accepted(self, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(self.ok(name, "sleep", "--json"))
        assert answer["type"] == "accepted", answer
        assert all(j["job_id"] for j in answer["jobs"]), answer
        return answer

    def wake(self, name: str, timeout: float = 150) -> dict[str, Any]:
        wake: dict[str, Any] = json.loads(self.ok(name, "wait", "--json", "--timeout", f"{timeout:g}"))
        assert wake == json.loads(
            (self.spaces[name] / ".syscall" / "wakes" / f"{wake['id']}.json").read_text()
        )
        return wake

    def wake_md(self, name: str, wake: dict[str, Any]) -> str:
        return wake_md(self.spaces[name], wake["id"])

    def budget(self, name: str) -> dict[str, Any]:
        """The budget as the kernel answers `status` now."""
        return json.loads(self.ok(name, "status", "--json"))["answer"]["budget"]  # type: ignore[no-any-return]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, slurm_conf: Path, bwrap_available: None) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("e2e-slurm")
    port = free_port()
    kernel = Kernel(tmp, CONFIG.replace("[slurm]", f'metrics_listen = "127.0.0.1:{port}"\n[slurm]'))
    spaces = {name: make_workspace(tmp / "spaces" / name) for name in SCENARIOS}
    for ws in spaces.values():
        kernel.enroll(ws, "--launches", "20", "--sleeps", "10", "--gpu-hours", f"{GPU_HOURS:g}")
    # systemd's notification socket, read by the outage scenario (STATUS=).
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify.sock"))
    notify.setblocking(False)
    kernel.start(env={"SLURM_CONF": str(slurm_conf), "NOTIFY_SOCKET": str(tmp / "notify.sock")})
    e = Env(kernel, spaces, slurm_conf, notify, port)
    try:
        # The slow scenario first, so that everything else runs while it waits for its walltime.
        e.ok(
            "walltime",
            "launch",
            "--name",
            "slow",
            "--minutes",
            "1",
            "--artifact",
            "ckpt.txt",
            "--",
            "sh",
            "-c",
            "echo 'epoch 1' > ckpt.txt; echo start; sleep 600",
        )
        e.accepted("walltime")
        yield e
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        notify.close()


def test_a_sweep_with_concurrency_2_is_throttled_by_slurm_beside_a_failing_launch(env: Env) -> None:
    env.ok(
        "sweep",
        *("launch", "--name", "sweep", "--array", "4", "--concurrency", "2", "--artifact", "out.txt"),
        *("--", "sh", "-c", 'echo "task $SWEEP_INDEX"; echo "made $SWEEP_INDEX" > out.txt; sleep 2'),
    )
    env.ok("sweep", "launch", "--name", "bad", "--", "sh", "-c", "echo no >&2; exit 3")
    accepted = env.accepted("sweep")
    wake = env.wake("sweep")
    assert [(t["launch"], t["task"], t["state"], t["exit_code"]) for t in wake["tasks"]] == [
        *(("sweep", k, "COMPLETED", 0) for k in range(4)),
        ("bad", 0, "FAILED", 3),
    ]
    assert [t["job_id"] for t in wake["tasks"]] == [j["job_id"] for j in accepted["jobs"]]
    for t in wake["tasks"][:4]:
        assert t["stdout_tail"] == f"task {t['task']}\n"
        [art] = t["artifacts"]
        assert (env.spaces["sweep"] / ".syscall" / art["delivered"]).read_text() == f"made {t['task']}\n"
    assert wake["tasks"][4]["stderr_tail"] == "no\n"
    assert "non-zero status" in wake["tasks"][4]["hint"]
    # Slurm holds the throttle (the kernel submitted all four at once) ...
    array_id = wake["tasks"][0]["job_id"].partition("_")[0]
    shown = slurm(env.conf, "scontrol", "show", "job", array_id)
    assert "ArrayTaskThrottle=2" in shown.stdout, shown.stdout + shown.stderr
    # ... and never more than two tasks ran at once, by the wrapper's own timestamps.
    seq = accepted["sleep_seq"]

    def stamp(task: int, name: str) -> datetime:
        text = (env.task_dir("sweep", seq, "sweep", task, 4) / name).read_text().strip()
        return datetime.fromisoformat(text.replace("Z", "+00:00"))

    spans = sorted((stamp(k, "started"), stamp(k, "ended")) for k in range(4))
    for a, b, c in itertools.combinations(spans, 3):
        assert not (max(a[0], b[0], c[0]) < min(a[1], b[1], c[1])), f"three tasks overlapped: {spans}"
    assert wake["budget"] == env.budget("sweep")


def test_a_launchs_own_memory_and_cpus_are_slurms_allocation_and_in_the_wake(env: Env) -> None:
    """`launch --mem 48 --cpus 2` through the kernel: Slurm allocates exactly that (the site's default is
    [slurm] mem_mb and cpus_per_task), the job runs, and the wake says what the launch asked for."""
    env.ok("sized", "launch", "--name", "sized", "--mem", "48", "--cpus", "2", "--", "sh", "-c", "echo ran")
    [job] = env.accepted("sized")["jobs"]
    shown = slurm(env.conf, "scontrol", "show", "job", "-o", job["job_id"])
    assert shown.returncode == 0, shown.stderr
    fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
    assert (fields["MinMemoryNode"], fields["CPUs/Task"]) == ("48M", "2"), shown.stdout
    wake = env.wake("sized", 90)
    [t] = wake["tasks"]
    assert (t["state"], t["stdout_tail"]) == ("COMPLETED", "ran\n"), t
    [x] = wake["launches"]
    assert (x["mem_mb"], x["cpus"]) == (48, 2)
    assert "sized (48 MB, 2 CPUs per task): sh -c 'echo ran'" in env.wake_md("sized", wake)


def test_cancel_through_the_kernel_stops_a_running_job(env: Env) -> None:
    # No --gpus: this cluster has no GPUs (asking for one is the refusal scenario below).
    env.ok(
        "cancel",
        *("launch", "--name", "long", "--artifact", "ckpt.txt"),
        *("--", "sh", "-c", "echo 'epoch 1' > ckpt.txt; echo up; sleep 600"),
    )
    accepted = env.accepted("cancel")
    wait_output(env.task_dir("cancel", accepted["sleep_seq"], "long"), "up\n")
    answer = json.loads(env.ok("cancel", "cancel", "--json"))
    assert [(j["launch"], j["task"]) for j in answer["cancelled"]] == [("long", 0)]
    wake = env.wake("cancel", 60)
    [t] = wake["tasks"]
    assert (t["state"], t["stdout_tail"]) == ("CANCELLED", "up\n")
    assert t["hint"] is None or "outside" not in t["hint"]
    # What it had written by then is delivered, marked partial.
    [art] = t["artifacts"]
    assert (art["path"], art["partial"]) == ("ckpt.txt", True)
    assert (env.spaces["cancel"] / ".syscall" / art["delivered"]).read_text() == "epoch 1\n"
    assert wake["budget"] == env.budget("cancel")
    assert (wake["budget"]["reserved_gpu_hours"], wake["budget"]["gpu_hours"]) == (0, GPU_HOURS)


def test_a_job_killed_with_scancel_outside_the_kernel_is_cancelled_with_a_hint(env: Env) -> None:
    env.ok("outside", "launch", "--name", "victim", "--", "sh", "-c", "echo up; sleep 600")
    accepted = env.accepted("outside")
    [job] = accepted["jobs"]
    wait_output(env.task_dir("outside", accepted["sleep_seq"], "victim"), "up\n")
    done = slurm(env.conf, "scancel", job["job_id"])
    assert done.returncode == 0, done.stderr
    wake = env.wake("outside", 90)
    [t] = wake["tasks"]
    assert (t["state"], t["job_id"], t["stdout_tail"]) == ("CANCELLED", job["job_id"], "up\n")
    assert "outside the kernel" in t["hint"], t
    assert "outside the kernel" in env.wake_md("outside", wake)


def test_a_sleep_slurm_refuses_for_good_is_rejected_refunded_and_left_with_nothing_running(env: Env) -> None:
    before = env.budget("refused")
    # The first launch is accepted by sbatch; the second asks for a GPU this cluster does not have.
    env.ok("refused", "launch", "--name", "fine", "--", "sh", "-c", "sleep 600")
    env.ok("refused", "launch", "--name", "gpu", "--gpus", "1", "--", "sh", "-c", "true")
    done = env.tool("refused", "sleep", "--json")
    answer = json.loads(done.stdout)
    assert answer["type"] == "rejected", answer
    assert answer["error"]["code"] == "backend.refused"
    assert "'gpu'" in answer["error"]["message"]
    assert "gres" in answer["error"]["message"].lower()
    # Exactly refunded: nothing reserved, nothing spent.
    assert env.budget("refused") == before
    # The launch sbatch had accepted is cancelled, not left running half a sleep.
    names = jobs_named(env.conf, f"sk-{env.key('refused')}-")
    fine = job_name(env.key("refused"), 1, "fine")
    assert set(names) == {fine}, names
    assert len(names[fine]) == 1

    def cancelled() -> bool:
        [job_id] = names[fine]
        out = slurm(env.conf, "squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T")
        return out.stdout.strip() == "CANCELLED"

    wait_for(cancelled, 60, "the accepted half of the sleep to be cancelled", step=0.5)


def test_slurmctld_down_for_30_s_fails_no_job_and_the_wake_comes_after_it_returns(env: Env) -> None:
    env.ok(
        "outage",
        *("launch", "--name", "steps", "--array", "2", "--concurrency", "1"),
        *("--", "sh", "-c", 'echo "step $SWEEP_INDEX"; sleep 5'),
    )
    accepted = env.accepted("outage")
    seq = accepted["sleep_seq"]
    wait_for((env.task_dir("outage", seq, "steps", 0, 2) / "started").exists, 60, "task 0 to start")
    wake_dir = env.spaces["outage"] / ".syscall" / "wakes"
    stopped = time.time()
    cluster_ctl(env.conf, "ctl-stop")
    down = time.time()  # slurmctld is gone by now (it was between `stopped` and here)
    seen: dict[str, str] = {}
    try:
        assert slurm(env.conf, "squeue", "-h").returncode != 0, "slurmctld still answers"
        down_until = time.monotonic() + OUTAGE_S

        # The outage lasts OUTAGE_S whatever happens; all along, task 1 cannot start and no wake appears. Once the
        # kernel's calls fail, it shows where an operator looks (issue 24): `status`, STATUS=, the metrics.
        def outage_over() -> bool:
            assert not list(wake_dir.glob("*.json")), "a wake came while slurmctld was down"
            assert not (env.task_dir("outage", seq, "steps", 1, 2) / "started").exists()
            if "status" not in seen:
                line = json.loads(env.kernel.cli("status", "--json").stdout)["kernel_status"] or ""
                if line.startswith("degraded (Slurm unreachable since "):
                    seen["status"] = line
            if "STATUS" not in seen:
                for x in env.status_lines():
                    if "Slurm unreachable since " in x:
                        seen["STATUS"] = x
            if "metrics" not in seen and env.metric("syscall_kernel_degraded") == 1:
                seen["metrics"] = str(env.metric("syscall_kernel_slurm_outage_since_seconds"))
            return time.monotonic() >= down_until

        wait_for(outage_over, OUTAGE_S + 5, "the end of the outage", step=0.5)
        # Task 0 ended during the outage: its wrapper's exit file said so, with no scheduler to ask.
        assert (env.task_dir("outage", seq, "steps", 0, 2) / "exit-code").exists()
    finally:
        cluster_ctl(env.conf, "ctl-start")
    back = time.time()
    assert set(seen) == {"status", "STATUS", "metrics"}, seen
    assert "calls failed, the latest squeue: " in seen["status"], seen
    # The gauge says when it began: the last call that answered, at most a poll interval and a client timeout
    # before slurmctld was stopped.
    assert stopped - 15 <= float(seen["metrics"]) <= down, (seen, stopped, down)
    wake = env.wake("outage", 120)
    assert [(t["task"], t["state"], t["stdout_tail"]) for t in wake["tasks"]] == [
        (0, "COMPLETED", "step 0\n"),
        (1, "COMPLETED", "step 1\n"),
    ]
    assert datetime.fromisoformat(wake["woken_at"].replace("Z", "+00:00")).timestamp() >= back - 1
    log = env.kernel.log_text()
    key = env.key("outage")
    ends = [line for line in log.splitlines() if "event=task_ended" in line and f"ws={key}" in line]
    assert len(ends) == 2, ends
    assert all("state=COMPLETED" in line for line in ends), ends
    # The job ids are on the lines, and the outage was logged when it began and when it ended (issue 12).
    ids = sorted({j["job_id"] for j in accepted["jobs"]})
    assert all(re.search(r" job=\S+ ", line) for line in ends), ends
    [submitted] = [line for line in log.splitlines() if "event=submitted" in line and f"ws={key}" in line]
    assert f"jobs={','.join(ids)}" in submitted or all(i.split("_")[0] in submitted for i in ids), submitted
    assert " ERROR event=slurm_outage " in log
    assert "WARNING event=slurm_call_failed call=squeue" in log
    assert "event=slurm_outage_ended lasted_s=" in log
    assert log.index(" ERROR event=slurm_outage ") < log.index("event=slurm_outage_ended")
    # Timed from its real start (the last call that answered), not from the first that failed: at least the time
    # slurmctld was down (issue 24: a 30 s outage was logged as 18 s).
    [ended] = [line for line in log.splitlines() if "event=slurm_outage_ended" in line]
    lasted = float(ended.split("lasted_s=")[1].split()[0])
    assert OUTAGE_S <= lasted <= back - stopped + 25, (lasted, ended)
    # Back: no longer degraded, everywhere.
    wait_for(
        lambda: (
            not (json.loads(env.kernel.cli("status", "--json").stdout)["kernel_status"] or "").startswith(
                "degraded"
            )
        ),
        20,
        "status to stop saying degraded",
    )
    wait_for(lambda: env.metric("syscall_kernel_slurm_outage_since_seconds") == 0, 20, "the gauge back at 0")


def test_the_walltime_kills_a_job_that_runs_too_long(env: Env) -> None:
    wake = env.wake("walltime", 240)
    [t] = wake["tasks"]
    assert (t["state"], t["stdout_tail"]) == ("TIMEOUT", "start\n"), t
    md = env.wake_md("walltime", wake)
    assert "Hint: stopped for running past the walltime you declared" in md
    # One minute declared; Slurm's warning comes within a minute of its due time, later than the minute itself
    # (the kernel's start-up allowance, Slurm's own pace): the hint says so rather than "hit the walltime".
    assert 0 < t["elapsed_s"] < 200
    assert "can be later than the declared minutes" in md
    # What it had written by then is delivered, marked partial.
    [art] = t["artifacts"]
    assert (art["path"], art["partial"]) == ("ckpt.txt", True)
    assert (env.spaces["walltime"] / ".syscall" / art["delivered"]).read_text() == "epoch 1\n"
    assert "(partial): 'ckpt.txt'." in md


def test_a_kernel_killed_between_sbatch_and_recording_the_id_submits_no_duplicate(
    tmp_path: Path, slurm_conf: Path, bwrap_available: None
) -> None:
    kernel = Kernel(tmp_path, CONFIG)
    ws = make_workspace(tmp_path / "ws")
    kernel.enroll(ws, "--launches", "5", "--sleeps", "5", "--gpu-hours", "1")
    key = workspace_key(ws.resolve())
    name = job_name(key, 1, "once")
    request = {
        "protocol": 1,
        "id": "s1",
        "type": "sleep",
        "launches": [{"name": "once", "command": "echo ran once"}],
    }
    try:
        kernel.start(env={"SLURM_CONF": str(slurm_conf), CRASH_ENV: "sbatch"})
        put_request(ws, "s1", request)
        assert kernel.proc is not None
        assert kernel.proc.wait(60) == -9
        kernel.ensure_stopped()
        assert "event=crash_injected step=sbatch" in kernel.log_text()
        launch_dir = RunPaths(kernel.state / "runs", key, 1, "once").launch_dir
        assert (launch_dir / S.SPEC_FILE).exists()
        assert not (launch_dir / S.JOB_FILE).exists(), "the id was recorded before the crash point"
        [first] = jobs_named(slurm_conf, name)[name]

        kernel.start(env={"SLURM_CONF": str(slurm_conf)})
        wake_file = ws / ".syscall" / "wakes" / "s1.json"
        wait_for(wake_file.exists, 90, "the wake")
        answer = wait_for(lambda: read_answer(ws, "s1"), 10, "the answer")
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
    assert jobs_named(slurm_conf, name) == {name: {first}}, "the restarted kernel submitted the job again"
    rec = msgspec.json.decode((launch_dir / S.JOB_FILE).read_bytes(), type=S.JobRecord)
    assert (rec.job_id, rec.adopted) == (first, True)
    assert [j["job_id"] for j in answer["jobs"]] == [first]
    wake = json.loads(wake_file.read_bytes())
    assert [(t["state"], t["job_id"], t["stdout_tail"]) for t in wake["tasks"]] == [
        ("COMPLETED", first, "ran once\n")
    ]
