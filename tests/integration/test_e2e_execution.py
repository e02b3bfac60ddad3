"""End to end: the installed tool, a real kernel process, the local backend and the bwrap jail.

One kernel serves every test of the module (each test has its own workspace, enrolled before the kernel starts),
so the module costs one start. The local backend runs with `[local] seconds_per_minute = 1` (a TEST ONLY
setting): a declared minute of walltime lasts one second, which makes the walltime kill take seconds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, git, make_workspace, run_tool, wait_for, wake_md

from channel.paths import workspace_key

pytestmark = pytest.mark.bwrap

SCENARIOS = (
    "artifact",
    "failing",
    "noimport",
    "notfound",
    "walltime",
    "serial",
    "cancel",
    "partial",
    "dirty",
    "symlink",
    "escape",
    "other",
    "filter",
    "unusable",
    "blocked",
)


class Env:
    def __init__(self, kernel: Kernel, spaces: dict[str, Path]) -> None:
        self.kernel = kernel
        self.spaces = spaces

    @property
    def run_dir(self) -> Path:
        return self.kernel.state / "runs"

    def key(self, name: str) -> str:
        return workspace_key(self.spaces[name].resolve())

    def tool(self, name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run_tool(self.spaces[name], *args, timeout=timeout)

    def ok(self, name: str, *args: str) -> str:
        done = self.tool(name, *args)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-2000:]}"
        return done.stdout

    def launch(self, name: str, *args: str) -> None:
        self.ok(name, "launch", *args)

    def sleep_wait(self, name: str) -> dict[str, Any]:
        """`sleep --wait --json`: the wake as the agent reads it."""
        wake = json.loads(self.ok(name, "sleep", "--wait", "--json", "--timeout", "60"))
        assert wake == json.loads(
            (self.spaces[name] / ".syscall" / "wakes" / f"{wake['id']}.json").read_text()
        )
        return wake  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("e2e")
    kernel = Kernel(tmp, 'jail = "bwrap"\n[local]\nseconds_per_minute = 1.0\n')
    spaces = {}
    for name in SCENARIOS:
        files = {"README": f"workspace {name}\n"}
        if name == "dirty":
            files["a.txt"] = "committed\n"
        if name == "other":
            files["secret.txt"] = "the other workspace's secret\n"
        spaces[name] = make_workspace(tmp / "spaces" / name, files)
        kernel.enroll(spaces[name], "--launches", "20", "--sleeps", "10", "--gpu-hours", "4")
    kernel.start()
    try:
        yield Env(kernel, spaces)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def only_task(wake: dict[str, Any]) -> dict[str, Any]:
    assert len(wake["tasks"]) == 1, wake
    return wake["tasks"][0]  # type: ignore[no-any-return]


def test_a_successful_launch_delivers_its_artifact_with_evidence(env: Env) -> None:
    env.launch(
        "artifact",
        "--name",
        "make",
        "--artifact",
        "out/a.txt",
        "--",
        "sh",
        "-c",
        "mkdir out; echo made > out/a.txt; echo done",
    )
    wake = env.sleep_wait("artifact")
    t = only_task(wake)
    assert (t["state"], t["exit_code"]) == ("COMPLETED", 0)
    assert t["stdout_tail"] == "done\n"
    [art] = t["artifacts"]
    delivered = env.spaces["artifact"] / ".syscall" / art["delivered"]
    assert art["delivered"] == f"results/{wake['seq']}/make/out/a.txt"
    assert art["partial"] is False  # its task ended on its own
    assert delivered.read_bytes() == b"made\n"
    assert (art["size"], art["sha256"]) == (5, hashlib.sha256(b"made\n").hexdigest())
    assert t["elapsed_s"] is not None
    md = wake_md(env.spaces["artifact"], wake["id"])
    assert "| make[0] | COMPLETED | 0 |" in md

    # The snapshot lives in the kernel's repository of the workspace (never the agent's .git) and its ref is
    # released once the sleep is woken (held bases, `refs/bases/...`, stay).
    repo = env.kernel.state / "runs" / "repos" / f"{workspace_key(env.spaces['artifact'].resolve())}.git"

    def snapshot_refs() -> list[str]:
        cmd = ["git", "--git-dir", str(repo), "for-each-ref", "--format=%(refname)", "refs/snapshots"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()

    wait_for(lambda: snapshot_refs() == [], 10, "the snapshot ref to be released")
    agent_refs = subprocess.run(
        ["git", "for-each-ref", "--format=%(refname)"],
        cwd=env.spaces["artifact"],
        capture_output=True,
        text=True,
    ).stdout
    assert "syscall" not in agent_refs


def test_a_failing_command_reports_its_exit_code_and_stderr(env: Env) -> None:
    env.launch("failing", "--name", "bad", "--", "sh", "-c", "echo boom >&2; exit 7")
    t = only_task(env.sleep_wait("failing"))
    assert (t["state"], t["exit_code"], t["signal"]) == ("FAILED", 7, None)
    assert t["stderr_tail"] == "boom\n"
    assert "non-zero status" in t["hint"]


def test_a_missing_import_gets_a_hint_that_says_how_to_add_it(env: Env) -> None:
    # the system python3 of the jail (no uv.lock in this workspace): the hint names the module and `uv add`
    env.launch("noimport", "--name", "imp", "--", "python3", "-c", "import torchvision.models")
    t = only_task(env.sleep_wait("noimport"))
    assert t["state"] == "FAILED"
    assert "No module named 'torchvision'" in t["stderr_tail"]
    assert "could not import `torchvision`" in t["hint"], t["hint"]
    assert "`uv add torchvision`" in t["hint"]
    assert "in the snapshot" in t["hint"]


def test_a_command_the_jail_lacks_gets_a_hint_that_says_where_commands_come_from(env: Env) -> None:
    env.launch("notfound", "--name", "nf", "--", "no-such-tool-xyz", "--train")
    t = only_task(env.sleep_wait("notfound"))
    assert (t["state"], t["exit_code"]) == ("FAILED", 127)
    assert "no-such-tool-xyz: not found" in t["stderr_tail"]
    assert "found no command `no-such-tool-xyz` (exit 127)" in t["hint"], t["hint"]
    assert "`syscall env` says what they get" in t["hint"]


def test_the_walltime_kills_a_job_that_runs_too_long(env: Env) -> None:
    # 1 minute of walltime is 1 s on this kernel ([local] seconds_per_minute = 1).
    env.launch(
        "walltime", "--name", "slow", "--minutes", "1", "--", "sh", "-c", "echo start; sleep 60; echo never"
    )
    t = only_task(env.sleep_wait("walltime"))
    assert t["state"] == "TIMEOUT"
    assert t["stdout_tail"] == "start\n"
    # elapsed is `started` -> `ended`: the wrapper's own start-up (compiling job.sh, ~0.05 s idle, several
    # times that on a loaded machine) comes out of the 1 s walltime, which the backend counts from the spawn.
    assert 0.5 <= t["elapsed_s"] < 15


def test_an_array_with_concurrency_one_runs_its_tasks_one_at_a_time(env: Env) -> None:
    env.launch(
        "serial",
        "--name",
        "sweep",
        "--array",
        "3",
        "--concurrency",
        "1",
        "--",
        "sh",
        "-c",
        'echo "task $SWEEP_INDEX"; sleep 0.3',
    )
    wake = env.sleep_wait("serial")
    assert [(t["task"], t["state"], t["stdout_tail"]) for t in wake["tasks"]] == [
        (i, "COMPLETED", f"task {i}\n") for i in range(3)
    ]
    sleep_dir = env.run_dir / env.key("serial") / str(wake["seq"])

    def stamp(task: int, name: str) -> datetime:
        return datetime.fromisoformat(
            (sleep_dir / f"sweep.{task}" / name).read_text().strip().replace("Z", "+00:00")
        )

    spans = sorted((stamp(i, "started"), stamp(i, "ended")) for i in range(3))
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, f"tasks overlapped: {spans}"


def test_cancel_stops_running_and_queued_tasks_and_refunds_their_reservation(env: Env) -> None:
    # Two tasks, one at a time: task 0 runs, task 1 waits in the backend's queue.
    env.launch(
        "cancel",
        *("--name", "long", "--array", "2", "--concurrency", "1", "--gpus", "1", "--minutes", "30"),
        *("--", "sh", "-c", 'echo "up $SWEEP_INDEX"; sleep 300'),
    )
    accepted = json.loads(env.ok("cancel", "sleep", "--json"))
    assert accepted["budget"]["reserved_gpu_hours"] == 1.0
    sleep_dir = env.run_dir / env.key("cancel") / str(accepted["sleep_seq"])
    wait_for((sleep_dir / "long.0" / "started").exists, 20, "task 0 to start")
    answer = json.loads(env.ok("cancel", "cancel", "--json"))
    assert [(j["launch"], j["task"]) for j in answer["cancelled"]] == [("long", 0), ("long", 1)]
    wake = json.loads(env.ok("cancel", "wait", "--json", "--timeout", "30"))
    running, queued = wake["tasks"]
    assert (running["state"], running["stdout_tail"]) == ("CANCELLED", "up 0\n")
    assert (queued["state"], queued["stdout_tail"], queued["elapsed_s"]) == ("CANCELLED", "", None)
    assert queued["hint"] == "cancelled before it started"
    assert not (sleep_dir / "long.1" / "started").exists()
    assert wake["budget"]["reserved_gpu_hours"] == 0
    # 4 GPU-hours granted; task 0 used a few GPU-seconds at most, task 1 none.
    assert 3.99 <= wake["budget"]["gpu_hours"] <= 4.0
    assert wake["refunded_gpu_hours"] >= 0.99
    # budget.json is rewritten after the refund (PROTOCOL 9.2), which orders it against no wake or answer: the
    # wake may be readable first, so this waits for the file to show the wake's balance.
    budget_json = env.spaces["cancel"] / ".syscall" / "budget.json"
    wait_for(
        lambda: json.loads(budget_json.read_text())["budget"] == wake["budget"], 30, "budget.json's refund"
    )


def test_a_timed_out_or_cancelled_task_delivers_its_artifacts_marked_partial(env: Env) -> None:
    """What a stopped task had written is delivered, marked partial in the wake's JSON and markdown (before:
    delivered, but the wake read as if the files were whole)."""
    ws = env.spaces["partial"]
    write = "mkdir -p out; echo 'epoch 1' > out/ckpt.txt; echo wrote; sleep 300"
    # 2 minutes of walltime are 2 s on this kernel
    env.launch(
        "partial", "--name", "slow", "--minutes", "2", "--artifact", "out/ckpt.txt", "--", "sh", "-c", write
    )
    wake = env.sleep_wait("partial")
    t = only_task(wake)
    assert t["state"] == "TIMEOUT", t
    [art] = t["artifacts"]
    assert (art["path"], art["partial"]) == ("out/ckpt.txt", True)
    assert (ws / ".syscall" / art["delivered"]).read_text() == "epoch 1\n"
    md = (ws / ".syscall" / "wakes" / f"{wake['id']}.md").read_text()
    assert (
        "Artifacts delivered as the job had written them when it was stopped (partial): 'out/ckpt.txt'." in md
    )
    assert f"- .syscall/results/{wake['seq']}/slow/: 'stdout', 'stderr', 'out/ckpt.txt' (partial)" in md

    env.launch("partial", "--name", "stop", "--artifact", "out/ckpt.txt", "--", "sh", "-c", write)
    accepted = json.loads(env.ok("partial", "sleep", "--json"))
    stdout = env.run_dir / env.key("partial") / str(accepted["sleep_seq"]) / "stop" / "stdout"
    wait_for(
        lambda: stdout.exists() and stdout.read_text() == "wrote\n", 20, "the task to write its artifact"
    )
    env.ok("partial", "cancel")
    wake = json.loads(env.ok("partial", "wait", "--json", "--timeout", "30"))
    t = only_task(wake)
    assert t["state"] == "CANCELLED", t
    [art] = t["artifacts"]
    assert (art["path"], art["partial"]) == ("out/ckpt.txt", True)
    assert (ws / ".syscall" / art["delivered"]).read_text() == "epoch 1\n"


def test_a_dirty_workspace_is_measured_as_it_is(env: Env) -> None:
    ws = env.spaces["dirty"]
    (ws / "a.txt").write_text("dirty\n")
    (ws / "b.txt").write_text("untracked\n")
    env.launch("dirty", "--name", "look", "--", "cat", "a.txt", "b.txt")
    t = only_task(env.sleep_wait("dirty"))
    assert (t["state"], t["stdout_tail"]) == ("COMPLETED", "dirty\nuntracked\n")


def test_a_symlink_to_etc_passwd_as_artifact_is_skipped_with_a_reason(env: Env) -> None:
    env.launch(
        "symlink", "--name", "sneak", "--artifact", "out.txt", "--", "ln", "-s", "/etc/passwd", "out.txt"
    )
    wake = env.sleep_wait("symlink")
    t = only_task(wake)
    assert t["state"] == "COMPLETED"
    assert t["artifacts"] == []
    [skip] = t["skipped"]
    assert skip["path"] == "out.txt"
    assert "symlink" in skip["reason"]
    assert not (
        env.spaces["symlink"] / ".syscall" / "results" / str(wake["seq"]) / "sneak" / "out.txt"
    ).exists()


def test_a_jailed_job_reaches_neither_kernel_files_nor_other_workspaces_nor_the_network(env: Env) -> None:
    secret = env.spaces["other"] / "secret.txt"
    state_db = env.kernel.state / "state.sqlite"
    run_dir = env.run_dir
    for path in (secret, state_db, run_dir):
        assert path.exists()  # what the jail must hide is really there
    connect = "import socket; socket.create_connection(('1.1.1.1', 53), timeout=3); print('connected')"
    env.launch("escape", "--name", "rundir", "--", "ls", str(run_dir))
    env.launch("escape", "--name", "state", "--", "cat", str(state_db))
    env.launch("escape", "--name", "other", "--", "cat", str(secret))
    env.launch("escape", "--name", "net", "--", "python3", "-c", connect)
    wake = env.sleep_wait("escape")
    by_name = {t["launch"]: t for t in wake["tasks"]}
    for name in ("rundir", "state", "other", "net"):
        t = by_name[name]
        assert t["state"] == "FAILED", t
        assert t["exit_code"] != 0
        assert t["stdout_tail"] == ""
    for name in ("rundir", "state", "other"):
        assert "No such file or directory" in by_name[name]["stderr_tail"]
    assert "unreachable" in by_name["net"]["stderr_tail"].lower()


def test_a_filter_driver_in_the_workspace_config_does_not_run(env: Env, tmp_path: Path) -> None:
    ws = env.spaces["filter"]
    marker = tmp_path / "filter-ran"
    (ws / ".gitattributes").write_text("* filter=evil\n")
    (ws / "data.txt").write_text("payload\n")
    for kind in ("clean", "smudge"):
        git(ws, "config", f"filter.evil.{kind}", f"sh -c 'touch {marker}; cat'")
    git(ws, "config", "filter.evil.process", f"sh -c 'touch {marker}'")
    env.launch("filter", "--name", "read", "--", "cat", "data.txt")
    t = only_task(env.sleep_wait("filter"))
    assert (t["state"], t["stdout_tail"]) == ("COMPLETED", "payload\n")
    assert not marker.exists(), "the workspace's filter driver ran"
    # The same config does run the driver under a plain git (the test can fail).
    subprocess.run(["git", "add", "data.txt"], cwd=ws, check=False, capture_output=True)
    assert marker.exists()


def test_a_workspace_that_cannot_be_snapshotted_is_refused_and_costs_nothing(env: Env) -> None:
    ws = env.spaces["unusable"]
    before = json.loads((ws / ".syscall" / "budget.json").read_text())["budget"]
    index = ws / ".git" / "index"
    index.rename(ws.parent / "unusable-index")
    index.symlink_to(ws.parent / "unusable-index")  # the kernel never reads .git through a link
    env.launch("unusable", "--name", "x", "--gpus", "1", "--", "true")
    done = env.tool("unusable", "sleep")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "snapshot.failed" in done.stdout + done.stderr
    assert ".git/index is a symlink" in done.stdout + done.stderr
    assert json.loads((ws / ".syscall" / "budget.json").read_text())["budget"] == before
    assert not (env.run_dir / env.key("unusable")).exists()


def test_a_wakes_directory_swapped_for_a_symlink_is_never_written_through(env: Env, tmp_path: Path) -> None:
    ws = env.spaces["blocked"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env.launch("blocked", "--name", "x", "--", "sh", "-c", "sleep 1")
    accepted = json.loads(env.ok("blocked", "sleep", "--json"))
    # While the job runs, the agent swaps its wakes/ for a symlink to a directory outside the channel.
    (ws / ".syscall" / "wakes").rmdir()
    (ws / ".syscall" / "wakes").symlink_to(elsewhere)

    def problem() -> str | None:
        for w in json.loads(env.kernel.cli("status", "--json").stdout)["workspaces"]:
            if w["path"] == str(ws) and w["problem"] and "wakes" in w["problem"]:
                return str(w["problem"])
        return None

    # Spec 2.3: the subdirectory is not the one enrolled, so this workspace alone stops (its problem in
    # status) until the operator adopts it; the wake stays in the kernel, and nothing goes through the link.
    wait_for(problem, 30, f"the swapped wakes/ of sleep {accepted['id']} reported in status")
    time.sleep(3)  # the job has ended meanwhile; its wake must not have been written anywhere
    assert list(elsewhere.iterdir()) == []
