"""Disk exhaustion (issue 23, items 7 and 9): a full run directory is a refusal, not a crash; a job's writable tree
has a size limit. Both end to end through the agent's tool: `launch`, `sleep --wait` (the text an agent reads),
`wait --json` (the same wake as JSON), `status`, against a real kernel with the default bwrap jail.

Item 7: the run directory is a 64 MiB tmpfs and a job prints far more than that. The kernel used to crash on
`OSError: [Errno 28]` (writing the exit record of the wrapper that died on it) and crash-loop in recovery. Now the
wrapper stops the job, its exit record (written into space reserved before the job ran) says `disk_full`, the
wake the agent reads shows the task FAILED with the disk-full hint, another workspace's `status` is answered (its
sleep waits while the disk stays full and runs once space is back) and a restarted kernel recovers without
crashing.

Item 9: `[local] tree_mb` bounds what a job writes into its tree, home and work directories: one big fallocate is
refused at once (RLIMIT_FSIZE: EFBIG and SIGXFSZ), many smaller files are summed by the wrapper's watchdog, which
stops the job; either way the task is FAILED with kind `disk_limit`, the hint the agent reads says the limit, and
another workspace's sleep still runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, git_workspace, run_tool, tool_popen
from testenv import fill, scratch_gone, tmpfs

pytestmark = pytest.mark.bwrap


@pytest.fixture
def small_run_dir(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "runs", "64m") as run:
        yield run


def tool(k: Kernel, ws: Path, *args: str, timeout: float = 60) -> str:
    """The agent's tool in `ws`, which must succeed: its stdout."""
    done = run_tool(ws, *args, timeout=timeout)
    assert done.returncode == 0, f"syscall {' '.join(args)}: {done.stdout}{done.stderr}{k.log_text()[-3000:]}"
    return done.stdout


def sleep_and_read(k: Kernel, ws: Path, name: str, command: str) -> tuple[str, dict[str, Any]]:
    """Stage `command` as launch `name` and `sleep --wait` on it as an agent does: the wake's text the agent
    reads, and the same wake as JSON (`wait --json ID`, answered from the wake already there)."""
    tool(k, ws, "launch", "--name", name, "--", command)
    text = tool(k, ws, "sleep", "--wait", "--timeout", "240", timeout=300)
    found = re.search(r"^Sleep (\S+) accepted", text, re.MULTILINE)
    assert found, text
    return text, json.loads(tool(k, ws, "wait", "--json", found[1]))


def says_failed_with(text: str, task: dict[str, Any]) -> None:
    """The wake's text says what its JSON says: the task FAILED, with its hint."""
    assert f"### {task['launch']}[{task['task']}]: FAILED" in text, text
    assert f"Hint: {task['hint']}." in text, text


def woken(k: Kernel, ws: Path, sleeping: subprocess.Popen[str]) -> dict[str, Any]:
    """The wake a `sleep --wait --json` started earlier prints; if its wait for the kernel's answer timed out
    (exit 4: the kernel was restarted meanwhile), `wait --json` follows the sleep, as the tool says to."""
    out, err = sleeping.communicate(timeout=300)
    if sleeping.returncode == 4:
        assert "syscall wait" in err, err
        out = tool(k, ws, "wait", "--json", "--timeout", "240", timeout=300)
    else:
        assert sleeping.returncode == 0, out + err + k.log_text()[-3000:]
    return json.loads(out)  # type: ignore[no-any-return]


# ~200 MiB of output: three times the run directory's filesystem, more than the per-stream cap (64 MiB) too.
FLOOD = "yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx | head -c 209715200"


def alive(k: Kernel) -> None:
    assert k.proc is not None
    assert k.proc.poll() is None, k.log_text()[-3000:]
    assert "event=crashed" not in k.log_text()


def test_a_job_printing_past_the_run_directorys_free_space_fails_its_task_and_the_kernel_serves_on(
    tmp_path: Path, small_run_dir: Path, bwrap_available: None
) -> None:
    k = Kernel(tmp_path, f'run_dir = "{small_run_dir}"\nrescan_seconds = 1\n[environment]\nmode = "none"\n')
    a, b = git_workspace(tmp_path / "a"), git_workspace(tmp_path / "b")
    (b / "data.txt").write_text("b's own file\n" * 10000)  # its snapshot writes objects on the full disk
    k.enroll(a)
    k.enroll(b)
    scratch = tmp_path / "scratch"  # the jobs' trees live on the kernel's TMPDIR, not on the small disk
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    try:
        k.start(env=env)
        text, wake = sleep_and_read(k, a, "flood", FLOOD)
        [task] = wake["tasks"]
        assert task["state"] == "FAILED", task
        says_failed_with(text, task)
        # What the hint says is so: the disk filled, and what was stored of the output fits on it.
        stored = re.match(
            r"the run directory's disk is full: the job's output could not be stored past (\d+) bytes of one "
            r"stream, so the job was stopped;",
            task["hint"],
        )
        assert stored, task["hint"]
        assert int(stored[1]) <= 64 << 20, task
        assert shutil.disk_usage(small_run_dir).free < 4 << 20, "the disk never filled"
        alive(k)

        # The disk stays full: another workspace is still answered; its sleep waits (the world's fault: its run
        # directory cannot be written, tried again every second) and runs once space is back.
        tool(k, b, "launch", "--name", "hello", "--", "echo hello")
        sleeping = tool_popen(b, "sleep", "--wait", "--json")
        k.wait_log(f"event=executor_unavailable ws={b.name}-", 30)
        assert "hello[0] PENDING" in tool(k, b, "status")  # b's status is answered: its task waits
        alive(k)
        for log in small_run_dir.glob("*/*/*/stdout"):  # the operator frees space
            log.unlink()
        [other] = woken(k, b, sleeping)["tasks"]
        assert (other["state"], other["stdout_tail"]) == ("COMPLETED", "hello\n"), other
        assert "snapshot.failed" not in k.log_text()  # a full disk is the world's fault, not the agent's
        k.wait_log(f"event=woken ws={b.name}-", 30)  # the sleep is over (its wake file comes first)

        # A restart with the disk full again (a sleep waiting to be written out) recovers and serves.
        fill(small_run_dir / "filler")
        tool(k, b, "launch", "--name", "again", "--", "echo again")
        sleeping = tool_popen(b, "sleep", "--wait", "--json")
        k.wait_log(f"event=executor_unavailable ws={b.name}-", 30, count=2)
        assert k.stop() == 0
        k.start(env=env)
        tool(k, a, "status")
        alive(k)
        (small_run_dir / "filler").unlink()
        [again] = woken(k, b, sleeping)["tasks"]
        assert (again["state"], again["stdout_tail"]) == ("COMPLETED", "again\n"), again
        alive(k)
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
    scratch_gone(scratch)


@pytest.fixture
def scratch_fs(tmp_path: Path) -> Iterator[Path]:
    """The jobs' scratch (the kernel's TMPDIR) on a filesystem of its own, so what a job writes is measured."""
    with tmpfs(tmp_path / "scratch", "1g") as where:
        yield where


class PeakUse:
    """The most of `path`'s filesystem in use at any moment (polled every millisecond) while it runs."""

    def __init__(self, path: Path) -> None:
        import threading

        self.path, self.base, self.peak = path, shutil.disk_usage(path).used, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


TREE_MB = 32
# What a job may write in one interval of the watchdog beyond the limit, measured on this test's tmpfs (see
# docs/threat-model.md, Disk quotas): up to 39 MiB here, 67 MiB on a fully loaded machine, 186 MiB with the test
# suite's 6 workers on 2 cores (the watchdog's thread waits for a core while the writer runs). The bound still
# tells a stopped job (32 + 256 MiB at most) from one that was not (6 GiB, or the 400 MiB of `many-files`).
OVERSHOOT_MB = 256


PY_FALLOCATE = (
    'python3 -c "import os, sys\n'
    "for i in range(int(sys.argv[1])):\n"
    " fd = os.open('g%d' % i, os.O_CREAT | os.O_WRONLY)\n"
    " os.posix_fallocate(fd, 0, int(sys.argv[2]) << 20)\n"
    " os.close(fd)\n"
    '" {n} {mb} && echo wrote all'
)
LIMIT_HINT = f"the job's tree exceeded its {TREE_MB} MiB disk limit"


@pytest.mark.parametrize(
    ("name", "command", "says"),
    [
        # fallocate(2) is refused in the jail (EOPNOTSUPP): the tool says so and fails, nothing is allocated
        ("fallocate-tool", "fallocate -l 6G big && echo wrote all", None),
        # glibc's posix_fallocate then writes the file, which RLIMIT_FSIZE stops at the limit (SIGXFSZ)
        ("one-posix-fallocate", PY_FALLOCATE.format(n=1, mb=6144), f"a file it wrote reached {TREE_MB} MiB"),
        ("many-posix-fallocates", PY_FALLOCATE.format(n=400, mb=16), "held"),
        # 20 MiB files deleted while held open: no walk of the tree sees them, /proc/PID/fd does
        (
            "deleted-open-files",
            'python3 -c "import os, time\n'
            "fds = []\n"
            "for i in range(20):\n"
            " fd = os.open('d', os.O_CREAT | os.O_WRONLY | os.O_TRUNC)\n"
            " os.write(fd, bytes(20 << 20))\n"
            " os.unlink('d')\n"
            " fds.append(fd)\n"
            " time.sleep(0.05)\n"
            '" && echo wrote all',
            "held",
        ),
        # a file below 1500 nested directories (deeper than the walk goes): the job is stopped, unmeasured
        (
            "too-deep",
            'python3 -c "import os\n'
            "fd = os.open('.', os.O_RDONLY)\n"
            "for i in range(1500):\n"
            " os.mkdir('d', dir_fd=fd)\n"
            " fd = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
            "out = os.open('big', os.O_CREAT | os.O_WRONLY, dir_fd=fd)\n"
            "for i in range(100):\n"
            " os.write(out, bytes(1 << 20))\n"
            " os.fsync(out)\n"
            '" && sleep 5 && echo wrote all',
            "could not be measured",
        ),
        # every inode counts at least a block: 8192 empty files are 32 MiB
        (
            "empty-files",
            # Creating them can outrun the watchdog's walk over them (its interval, seconds on a loaded machine), so
            # the job then waits: stopped by the limit, not by its end (without the watchdog it would complete).
            "python3 -c \"[open('e%d' % i, 'w').close() for i in range(200000)]\" && echo created && sleep 60 "
            "&& echo wrote all",
            "held",
        ),
        (
            "many-files",
            "i=0; while [ $i -lt 400 ]; do head -c 1048576 /dev/zero > f$i; i=$((i+1)); done; echo wrote all",
            "held",
        ),
    ],
)
def test_a_job_writing_past_its_tree_limit_is_stopped_and_the_disk_does_not_grow_past_it(
    tmp_path: Path, scratch_fs: Path, bwrap_available: None, name: str, command: str, says: str | None
) -> None:
    k = Kernel(
        tmp_path,
        f'rescan_seconds = 1\n[environment]\nmode = "none"\n[local]\ntree_mb = {TREE_MB}\nmem_mb = 2048\n',
    )
    ws, other = git_workspace(tmp_path / "ws"), git_workspace(tmp_path / "other")
    k.enroll(ws)
    k.enroll(other)
    try:
        k.start(env={"TMPDIR": str(scratch_fs)})
        peak = PeakUse(scratch_fs)
        text, wake = sleep_and_read(k, ws, "big", command)
        grown = peak.stop()
        [task] = wake["tasks"]
        alive(k)
        # The kernel serves on: another workspace's job runs (on the same scratch, under the same limit).
        _, served = sleep_and_read(k, other, "hello", "echo hello")
        [hello] = served["tasks"]
        assert (hello["state"], hello["stdout_tail"]) == ("COMPLETED", "hello\n"), hello
        alive(k)
        assert k.stop() == 0
    finally:
        k.ensure_stopped()
    assert task["state"] == "FAILED", task
    if says is None:
        assert "fallocate failed: Operation not supported" in task["stderr_tail"], task
        assert "### big[0]: FAILED" in text, text
    else:
        says_failed_with(text, task)
        assert task["hint"].startswith(LIMIT_HINT if says != "could not be measured" else "the job's tree"), (
            task
        )
        assert says in task["hint"], task
        held = re.search(r"held (\d+) MiB when it was stopped", task["hint"])
        if held:  # what the hint says the job held is past the limit, by no more than the overshoot
            assert int(held[1]) >= TREE_MB, task
            # Empty files are counted at 4 KiB each, and the watchdog's walk over 100,000 of them is itself its
            # interval (seconds on a loaded machine): that figure bounds files, not bytes; the disk's own growth
            # is bounded below for every case.
            if name != "empty-files":
                assert int(held[1]) <= TREE_MB + OVERSHOOT_MB, task
    assert "wrote all" not in task["stdout_tail"], task
    print(f"{name}: the scratch filesystem grew by at most {grown / (1 << 20):.1f} MiB (limit {TREE_MB} MiB)")
    assert grown <= (TREE_MB + OVERSHOOT_MB) << 20, grown
    scratch_gone(scratch_fs)
