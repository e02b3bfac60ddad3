"""A launch's own memory and CPUs on the local backend, end to end: the installed tool, a real kernel, bwrap.

The site sets no memory limit ([local] mem_mb = 0), so a launch without `--mem` keeps today's behaviour (no
limit), and one with `--mem 64` is held to 64 MB: allocating 200 MB ends it OUT_OF_MEMORY (FAILED with a
MemoryError where only rlimits are available), with a hint that names the limit, `--mem` and the workspace's
ceiling. `--cpus 1` holds two busy processes to one CPU's worth of time. A request over the workspace's ceiling
(`enroll --max-mem-mb 1024 --max-cpus 1`) is refused with the path, the ceiling and the fix.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, run_tool, wake_md

from kernel.node.wrapper import limits_mechanism

pytestmark = pytest.mark.bwrap

HOG = "python3 -c 'x = bytearray(200 << 20); x[-1] = 1; print(len(x))'"
# Two processes spin for 1.5 s of wall time; the CPU time they got over the wall time is how many CPUs they had.
SPIN = """\
import json, os, resource, time
t0 = time.time()
pids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.time() - t0 < 1.5:
            pass
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"cpus_used": (ru.ru_utime + ru.ru_stime) / (time.time() - t0)}))
"""


class Env:
    def __init__(self, kernel: Kernel, ws: Path) -> None:
        self.kernel, self.ws = kernel, ws

    def tool(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_tool(self.ws, *args, timeout=60)

    def ok(self, *args: str) -> str:
        done = self.tool(*args)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-2000:]}"
        return done.stdout

    def sleep_wait(self) -> dict[str, Any]:
        return json.loads(self.ok("sleep", "--wait", "--json", "--timeout", "90"))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("resources")
    kernel = Kernel(tmp, 'jail = "bwrap"\n[environment]\nmode = "none"\n')
    ws = make_workspace(tmp / "ws", {"README": "resources\n", "spin.py": SPIN})
    kernel.enroll(ws, "--launches", "20", "--sleeps", "10", "--max-mem-mb", "1024", "--max-cpus", "1")
    kernel.start()
    try:
        yield Env(kernel, ws)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def test_a_launch_asking_for_64_mb_is_held_to_it_while_the_default_is_not(env: Env) -> None:
    env.ok("launch", "--name", "small", "--mem", "64", "--", HOG)
    env.ok("launch", "--name", "plain", "--", HOG)
    wake = env.sleep_wait()
    tasks = {t["launch"]: t for t in wake["tasks"]}
    assert (tasks["plain"]["state"], tasks["plain"]["stdout_tail"]) == ("COMPLETED", f"{200 << 20}\n")
    small = tasks["small"]
    if limits_mechanism() == "cgroup":
        assert small["state"] == "OUT_OF_MEMORY", small
        assert small["hint"] == (
            "the task went over its memory limit of 64 MB (its launch asked for it: `launch --mem`) and was "
            "killed; ask for more with `launch --mem MB` (this workspace allows up to 1024 MB per task, "
            "kernel.json policy.max_mem_mb), or use less memory, smaller batches or fewer workers"
        )
    else:
        assert small["state"] == "FAILED", small
        assert "MemoryError" in small["stderr_tail"]
    # The wake says what each launch asked for.
    summaries = {x["name"]: x for x in wake["launches"]}
    assert (summaries["small"]["mem_mb"], summaries["small"]["cpus"]) == (64, None)
    assert (summaries["plain"]["mem_mb"], summaries["plain"]["cpus"]) == (None, None)
    md = wake_md(env.ws, wake["id"])
    assert f"small (64 MB per task): {HOG}" in md
    assert f"plain: {HOG}" in md


def test_env_says_what_a_launch_may_ask_for(env: Env) -> None:
    assert (
        "resources:    a launch may ask for its own per task: --mem MB (at most 1024 MB) and --cpus N (at most 1); "
        "one that asks for neither gets the site's default"
    ) in env.ok("env")


def test_a_launch_asking_for_one_cpu_gets_one_cpus_worth_of_time(env: Env) -> None:
    env.ok("launch", "--name", "spin", "--cpus", "1", "--", "python3 spin.py")
    [t] = env.sleep_wait()["tasks"]
    assert t["state"] == "COMPLETED", t
    used = json.loads(t["result"])["cpus_used"]
    assert used <= 1.25, f"two busy processes of a --cpus 1 task used {used:.2f} CPUs"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--mem", "2G"),
            "$.launches[0].mem_mb is 2048 (MB per task); this workspace allows at most 1024 (kernel.json "
            "policy.max_mem_mb): ask for 1024 or less",
        ),
        (
            ("--cpus", "2"),
            "$.launches[0].cpus is 2 (per task); this workspace allows at most 1 (kernel.json policy.max_cpus): "
            "ask for 1 or fewer",
        ),
    ],
)
def test_a_request_over_the_workspaces_ceiling_is_refused_with_the_path_and_the_ceiling(
    env: Env, flags: tuple[str, ...], message: str
) -> None:
    done = env.tool("launch", "--name", "big", *flags, "--", "true")
    assert done.returncode != 0
    text = done.stdout + done.stderr
    assert message in text, text
    assert f"(this launch: {flags[0]})" in text, text
    assert "big" not in env.ok("status"), "nothing was staged"
