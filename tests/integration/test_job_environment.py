"""What a job sees, end to end: a real kernel, real uv, real bwrap, the local backend.

- A workspace with `pyproject.toml` + `uv.lock` (made by `uv lock` here, against PyPI) depending on `six`: its
  job imports it from the read-only venv the kernel built for that lock, with the network cut; the next sleep, in
  this workspace and in another with the same lockfile, reuses the warm cache (nothing downloaded: the cache's files are unchanged and the log says
  `built: false`); a lockfile that does not install is refused before anything is submitted, and refunded.
- Every job variable is set in every task; `environment.extra_dirs` is on PATH and read-only.
- Limits ([local] mem_mb, max_procs, tmp_mb): a memory hog ends OUT_OF_MEMORY (FAILED where only rlimits are
  available), a fork bomb ends FAILED while another workspace's questions are still answered, /tmp is capped.
- `syscall env` against this kernel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernelproc import Kernel, make_workspace, run_tool, wait_for
from testenv import IN_CI

from channel.paths import workspace_key
from kernel.io.envcache import uv_binary
from kernel.node.wrapper import limits_mechanism

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

PYTHON = "/usr/bin/python3"
PYPROJECT = """\
[project]
name = "demo"
version = "0.1.0"
requires-python = ">=3.8"
dependencies = ["six==1.16.0"]
"""
MEM_MB = 256
MAX_PROCS = 64
TMP_MB = 8
SPACES = ("locked", "twin", "broken", "stale", "respec", "site", "hog", "bomb", "bystander", "tmp", "plain")


def need(component: str, available: bool, why: str) -> None:
    """tests/conftest.py's rule: skip locally, fail in CI (that conftest is not importable from every run)."""
    if not available:
        message = f"{component} is not available: {why}"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: tests needing {component} must run)")
        pytest.skip(message)


def make_lock(tmp: Path) -> str:
    """`uv lock` of PYPROJECT against PyPI (the tests' one use of the network outside the kernel)."""
    proj = tmp / "lockgen"
    proj.mkdir()
    (proj / "pyproject.toml").write_text(PYPROJECT)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "UV_CACHE_DIR": str(tmp / "lockgen-cache")}
    for k in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "SSL_CERT_FILE"):
        if k in os.environ:
            env[k] = os.environ[k]
    done = subprocess.run(
        [uv_binary(), "lock", "--no-config", "--python", PYTHON],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    need("PyPI", done.returncode == 0, f"uv lock failed: {done.stderr[-500:]}")
    shutil.rmtree(tmp / "lockgen-cache", ignore_errors=True)
    return (proj / "uv.lock").read_text()


class Env:
    def __init__(self, kernel: Kernel, spaces: dict[str, Path], site: Path) -> None:
        self.kernel = kernel
        self.spaces = spaces
        self.site = site

    @property
    def run_dir(self) -> Path:
        return self.kernel.state / "runs"

    def key(self, name: str) -> str:
        return workspace_key(self.spaces[name].resolve())

    def tool(self, name: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return run_tool(self.spaces[name], *args, timeout=timeout)

    def ok(self, name: str, *args: str) -> str:
        done = self.tool(name, *args)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{self.kernel.log_text()[-3000:]}"
        return done.stdout

    def sleep_wait(self, name: str) -> dict[str, Any]:
        return json.loads(self.ok(name, "sleep", "--wait", "--json", "--timeout", "170"))  # type: ignore[no-any-return]

    def log_events(self, event: str) -> list[dict[str, str]]:
        """The kernel log's `event=NAME k=v ...` lines of one event, as dicts of strings."""
        out = []
        for line in self.kernel.log_text().splitlines():
            if f"event={event} " in line + " ":
                fields = line[line.index(f"event={event}") :].split(" ")
                out.append(dict(f.split("=", 1) for f in fields if "=" in f))
        return out


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Env]:
    need("python3 at /usr/bin/python3", os.path.exists(PYTHON), "the jobs' interpreter")
    tmp = tmp_path_factory.mktemp("jobenv")
    lock = make_lock(tmp)
    site = tmp / "site" / "bin"
    site.mkdir(parents=True)
    (site / "sitetool").write_text("#!/bin/sh\necho site tool ran\n")
    (site / "sitetool").chmod(0o755)
    kernel = Kernel(
        tmp,
        f'jail = "bwrap"\n[environment]\npython = "{PYTHON}"\nextra_dirs = ["{site}"]\n'
        f"[local]\nmem_mb = {MEM_MB}\nmax_procs = {MAX_PROCS}\ntmp_mb = {TMP_MB}\n",
    )
    spaces = {}
    for name in SPACES:
        files = {"README": f"workspace {name}\n"}
        if name in ("locked", "twin"):
            files |= {"pyproject.toml": PYPROJECT, "uv.lock": lock}
        if name == "broken":
            # A lock whose wheel is not on the index: uv's download fails.
            bad = lock.replace("six-1.16.0-py2.py3-none-any.whl", "six-0.0.0-py2.py3-none-any.whl")
            assert bad != lock
            files |= {"pyproject.toml": PYPROJECT, "uv.lock": bad}
        if name == "stale":
            # A dependency added to pyproject.toml without `uv lock`.
            stale = PYPROJECT.replace(
                'dependencies = ["six==1.16.0"]', 'dependencies = ["six==1.16.0", "attrs"]'
            )
            assert stale != PYPROJECT
            files |= {"pyproject.toml": stale, "uv.lock": lock}
        if name == "respec":
            # A version the lock does not satisfy: only uv's own check (`uv lock --check`) sees it.
            respec = PYPROJECT.replace('"six==1.16.0"', '"six>=1.17"')
            assert respec != PYPROJECT
            files |= {"pyproject.toml": respec, "uv.lock": lock}
        spaces[name] = make_workspace(tmp / "spaces" / name, files)
        kernel.enroll(spaces[name], "--launches", "20", "--sleeps", "10", "--gpu-hours", "4")
    kernel.start()
    try:
        yield Env(kernel, spaces, site)
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()


def cache_listing(env: Env) -> dict[str, float]:
    root = env.run_dir / "envs"
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and "workspaces" not in p.parts and "builds" not in p.parts and p.name != "used":
            out[str(p.relative_to(root))] = p.stat().st_mtime
    return out


IMPORT_AND_PROBE = (
    "import six, sys, socket\n"
    "print('six', six.__version__)\n"
    "print('prefix', sys.prefix)\n"
    "try:\n"
    "    socket.create_connection(('pypi.org', 443), timeout=3)\n"
    "    print('network on')\n"
    "except OSError:\n"
    "    print('network off')\n"
)


def test_a_locked_environment_is_built_once_and_imported_offline(env: Env) -> None:
    (env.spaces["locked"] / "probe.py").write_text(IMPORT_AND_PROBE)
    env.ok("locked", "launch", "--name", "imp", "--minutes", "2", "--", "python probe.py")
    wake = env.sleep_wait("locked")
    [t] = wake["tasks"]
    assert t["state"] == "COMPLETED", t
    out = t["stdout_tail"]
    assert "six 1.16.0" in out
    assert "network off" in out
    prefix = out.split("prefix ", 1)[1].split("\n", 1)[0]
    assert prefix != "/usr", "python must be the locked venv's, not the system's"
    ready = [e for e in env.log_events("environment_ready") if e.get("ws") == env.key("locked")]
    assert [e["built"] for e in ready] == ["True"]
    [entry] = [
        p for p in (env.run_dir / "envs").iterdir() if p.name not in ("workspaces", "python", "builds")
    ]
    assert "six" in (entry / "warm.log").read_text()
    assert ["six", "1.16.0"] in json.loads((entry / "ready.json").read_text())["packages"]
    # jobenv.json now names the locked environment, and `syscall env` shows it.
    doc = json.loads((env.spaces["locked"] / ".syscall" / "jobenv.json").read_text())
    assert {"name": "six", "version": "1.16.0"} in doc["locked"]["packages"]
    text = env.ok("locked", "env")
    assert "locked from uv.lock" in text
    assert "six 1.16.0" in text
    assert "network:      off" in text
    assert f"memory {MEM_MB} MB" in text
    # rewritten by the sleep, it still says what enforces the limits (it said "none" once a sleep ran)
    assert doc["limits"]["enforced_by"] == limits_mechanism()
    assert f"(enforced by {limits_mechanism()})" in text

    # A hostile job tries to poison the environment other jobs share (the venv's files are hard links of the
    # kernel's cache): every write fails, the venv is read-only in the jail.
    six_file = "$VIRTUAL_ENV/lib/python3.*/site-packages/six.py"
    poison = (
        f"for f in {six_file}; do echo 'raise SystemExit(99)' >> $f && echo APPENDED; done; "
        "touch $VIRTUAL_ENV/planted && echo PLANTED; "
        f"chmod u+w {six_file} && echo CHMODDED; "
        "python -c 'import six; print(\"six still\", six.__version__)'"
    )
    env.ok("locked", "launch", "--name", "poison", "--", poison)
    [t] = env.sleep_wait("locked")["tasks"]
    assert "APPENDED" not in t["stdout_tail"]
    assert "PLANTED" not in t["stdout_tail"]
    assert "CHMODDED" not in t["stdout_tail"]
    assert "six still 1.16.0" in t["stdout_tail"]
    assert "Read-only file system" in t["stderr_tail"]

    before = cache_listing(env)
    # Again, here and in another workspace with the same lockfile: the warm cache, nothing downloaded.
    for name in ("locked", "twin"):
        (env.spaces[name] / "probe.py").write_text(IMPORT_AND_PROBE)
        env.ok(name, "launch", "--name", "again", "--minutes", "2", "--", "python probe.py")
        [t] = env.sleep_wait(name)["tasks"]
        assert t["state"] == "COMPLETED", t
        assert "six 1.16.0" in t["stdout_tail"]
    assert cache_listing(env) == before, "the second and third sleeps must not touch the cache's files"
    builds = [e["built"] for e in env.log_events("environment_ready")]
    assert builds.count("True") == 1
    assert builds.count("False") >= 3


def budget_of(env: Env, name: str) -> dict[str, Any]:
    return json.loads((env.spaces[name] / ".syscall" / "budget.json").read_text())["budget"]  # type: ignore[no-any-return]


def refused_sleep(env: Env, name: str, code: str) -> str:
    """Launch a job in `name` and sleep: refused with `code`, nothing charged; the message."""
    before = budget_of(env, name)
    env.ok(name, "launch", "--name", "never", "--", "echo should not run")
    done = env.tool(name, "sleep", "--json")
    assert done.returncode == 3, done.stdout + done.stderr
    ans = json.loads(done.stdout)
    assert ans["type"] == "rejected"
    assert ans["error"]["code"] == code
    assert budget_of(env, name) == before
    return str(ans["error"]["message"])


def test_a_lockfile_that_does_not_install_wakes_its_sleep_with_the_error_refunded_exactly(env: Env) -> None:
    """Accepted at once (the build runs in the background), then woken with `environment.failed`: uv's own
    words, every task CANCELLED and never submitted, the budget exactly as before the sleep."""
    before = budget_of(env, "broken")
    env.ok("broken", "launch", "--name", "never", "--array", "2", "--gpus", "1", "--", "echo should not run")
    ans = json.loads(env.ok("broken", "sleep", "--json"))
    assert ans["type"] == "accepted", ans
    assert ans["building"]["state"] == "building"
    assert all(j["job_id"] is None for j in ans["jobs"])
    charged = ans["budget"]
    assert (charged["sleeps"], charged["launches"]) == (before["sleeps"] - 1, before["launches"] - 1)
    assert charged["reserved_gpu_hours"] > 0
    wake = json.loads(env.ok("broken", "wait", "--json", "--timeout", "170"))
    assert wake["error"]["code"] == "environment.failed"
    message = wake["error"]["message"]
    assert "uv" in message
    assert "six" in message, "uv's own message names what failed"
    assert [t["state"] for t in wake["tasks"]] == ["CANCELLED", "CANCELLED"]
    assert all(t["job_id"] is None for t in wake["tasks"])
    assert wake["budget"] == before
    assert budget_of(env, "broken") == before
    md = (env.spaces["broken"] / ".syscall" / "wakes" / f"{wake['id']}.md").read_text()
    assert "None of this sleep's tasks ran: `environment.failed`" in md
    sleep_dir = env.run_dir / env.key("broken")
    assert not list(sleep_dir.glob("*/never")), "nothing may be submitted"


def test_a_lock_out_of_date_with_pyproject_is_refused_with_uv_lock_and_refunded(env: Env) -> None:
    message = refused_sleep(env, "stale", "environment.lock_outdated")
    assert "uv.lock is out of date" in message
    assert "'attrs'" in message
    assert "run `uv lock`" in message
    # refused before any build: no uv ran for it
    assert not [e for e in env.log_events("environment_ready") if e.get("ws") == env.key("stale")]


def test_a_lock_that_does_not_satisfy_a_changed_specifier_is_refused_by_uvs_own_check(env: Env) -> None:
    """`six>=1.17` in pyproject.toml, `six 1.16.0` in uv.lock: the kernel's own comparison finds `six` locked;
    uv's offline `uv lock --check` (in the build jail, no network) does not, and the sleep is refused at once."""
    message = refused_sleep(env, "respec", "environment.lock_outdated")
    assert "uv.lock is out of date" in message
    assert "run `uv lock`" in message
    assert "six" in message, "uv's own words name the package"
    assert not [e for e in env.log_events("environment_building") if e.get("ws") == env.key("respec")]


def test_every_job_variable_is_set_in_every_task_and_extra_dirs_are_read_only_on_path(env: Env) -> None:
    line = 'echo "V $SWEEP_INDEX|$SYSCALL_TASK|$SLURM_ARRAY_TASK_ID|$SYSCALL_LAUNCH|$SYSCALL_SLEEP|$SYSCALL_SNAPSHOT"'
    env.ok("site", "launch", "--name", "vars", "--array", "2", "--", line)
    probe = f"sitetool; touch {env.site}/x 2>/dev/null && echo WROTE || echo READONLY"
    env.ok("site", "launch", "--name", "single", "--", line + "; " + probe)
    wake = env.sleep_wait("site")
    repo = env.run_dir / "repos" / f"{env.key('site')}.git"
    got = {(t["launch"], t["task"]): t["stdout_tail"] for t in wake["tasks"]}
    for (launch, task), out in got.items():
        first = out.splitlines()[0]
        idx, task_var, slurm, name, sleep, snap = first[2:].split("|")
        assert (idx, task_var, slurm, name) == (str(task), str(task), str(task), launch)
        assert sleep == wake["id"]
        kind = subprocess.run(
            ["git", "--git-dir", str(repo), "cat-file", "-t", snap], capture_output=True, text=True
        ).stdout.strip()
        assert kind == "commit", "SYSCALL_SNAPSHOT is the snapshot commit in the kernel's repository"
    assert "site tool ran" in got[("single", 0)]
    assert "READONLY" in got[("single", 0)]
    assert not (env.site / "x").exists()


def test_a_memory_hog_ends_out_of_memory(env: Env) -> None:
    env.ok(
        "hog",
        "launch",
        "--name",
        "hog",
        "--",
        f"python3 -c 'x = bytearray({4 * MEM_MB} << 20); print(len(x))'",
    )
    [t] = env.sleep_wait("hog")["tasks"]
    if limits_mechanism() == "cgroup":
        assert t["state"] == "OUT_OF_MEMORY", t
        assert "memory limit" in t["hint"]
    else:
        assert t["state"] == "FAILED", t
        assert "MemoryError" in t["stderr_tail"]


def test_a_fork_bomb_fails_and_another_workspace_is_still_answered(env: Env) -> None:
    bomb = (
        "import os, sys, time\n"
        "for i in range(100000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "    except OSError as e:\n"
        "        print('fork refused after', i, e); sys.exit(1)\n"
    )
    (env.spaces["bomb"] / "bomb.py").write_text(bomb)
    env.ok("bomb", "launch", "--name", "bomb", "--minutes", "2", "--", "python3 bomb.py")
    env.ok("bomb", "sleep")
    # While the bomb runs, another workspace's question is answered.
    wait_for(lambda: list((env.run_dir / env.key("bomb")).glob("*/bomb/started")), 60, "the bomb to start")
    t0 = time.monotonic()
    env.ok("bystander", "status", "--timeout", "30")
    assert time.monotonic() - t0 < 30
    wake = json.loads(env.ok("bomb", "wait", "--json", "--timeout", "170"))
    [t] = wake["tasks"]
    assert t["state"] == "FAILED", t
    assert "fork refused" in t["stdout_tail"]
    if limits_mechanism() == "cgroup":
        n = int(t["stdout_tail"].split("fork refused after ")[1].split()[0])
        assert n < MAX_PROCS


def test_tmp_is_capped(env: Env) -> None:
    env.ok(
        "tmp",
        "launch",
        "--name",
        "fill",
        "--",
        f"head -c {4 * TMP_MB}M /dev/zero > /tmp/big; echo rc=$?; df -m /tmp",
    )
    [t] = env.sleep_wait("tmp")["tasks"]
    assert "No space left" in t["stderr_tail"]
    assert "rc=1" in t["stdout_tail"]


def test_syscall_env_without_a_lockfile_says_the_system_python_and_how_to_lock(env: Env) -> None:
    text = env.ok("plain", "env")
    assert "the system's python3" in text
    assert "uv lock" in text
    assert "SWEEP_INDEX" in text
    assert "NOT ignored files, .git" in text
    data = json.loads(env.ok("plain", "env", "--json"))
    assert data["jobenv"]["locked"] is None
    assert data["workspace"]["uv_lock"] is False
    assert data["jobenv"]["limits"] == {
        "mem_mb": MEM_MB,
        "max_procs": MAX_PROCS,
        "tmp_mb": TMP_MB,
        "enforced_by": limits_mechanism(),
    }
