"""The package index a workspace's uv.lock must be made against (issue 24).

- It is published: `package_index` in kernel.json and jobenv.json (the configured `index_url`, else PyPI), and
  `syscall env` says it with the command to lock against it; absent where the kernel builds no environment.
- The advice a refused lock gets is literally the fix: a lock made against another index than the kernel's (the
  agent locked against PyPI, the site runs a mirror) is refused naming the exact `uv lock` command, and that
  command, run by the real uv against two real local HTTPS indexes, makes a lock the kernel accepts. (Before,
  the refusal said "lock again without a custom index": the opposite of the fix.)
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from kernelproc import Kernel, git_workspace, run_tool
from test_environment_build_jail import PYPROJECT, PYTHON, Server, make_tls, make_wheel

from kernel.io.envcache import lock_problem, uv_binary


@pytest.mark.parametrize(
    ("environment", "published"),
    [
        ('index_url = "https://mirror.example:8443/simple/"\n', "https://mirror.example:8443/simple"),
        ("", "https://pypi.org/simple"),
        ('mode = "none"\nindex_url = "https://mirror.example/simple"\n', None),
    ],
)
def test_the_index_is_published_in_kernel_json_jobenv_json_and_syscall_env(
    tmp_path: Path, environment: str, published: str | None
) -> None:
    k = Kernel(tmp_path, f'backend = "none"\n[environment]\n{environment}')
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    assert json.loads((ws / ".syscall" / "kernel.json").read_text())["package_index"] == published
    assert json.loads((ws / ".syscall" / "jobenv.json").read_text())["package_index"] == published
    (ws / "pyproject.toml").write_text(PYPROJECT)
    (ws / "uv.lock").write_text("version = 1\n")
    done = run_tool(ws, "env", timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    advice = f"make uv.lock with `uv lock --default-index {published}`"
    assert (advice in out) == (published is not None), out


@pytest.mark.slow
def test_a_lock_against_another_index_is_refused_with_the_command_that_fixes_it(tmp_path: Path) -> None:
    ca, context = make_tls(tmp_path)
    wheel = make_wheel([])
    default, mirror = Server(context, wheel, index=True), Server(context, wheel, index=True)
    try:
        proj = tmp_path / "agent"
        proj.mkdir()
        (proj / "pyproject.toml").write_text(PYPROJECT)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "UV_CACHE_DIR": str(tmp_path / "cache"),
            "SSL_CERT_FILE": str(ca),
            "NO_PROXY": "127.0.0.1",
        }

        def uv(*args: str) -> None:
            done = subprocess.run(
                [uv_binary(), *args], cwd=proj, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr

        # The agent's lock, made against "its" default index (not the kernel's).
        uv("lock", "--no-config", "--python", PYTHON, "--default-index", f"{default.url}/simple")
        kernel_index = f"{mirror.url}/simple"
        problem = lock_problem((proj / "uv.lock").read_bytes(), kernel_index)
        assert problem is not None
        assert "source.registry" in problem
        assert "without a custom index" not in problem
        commands = re.findall(r"`(uv lock [^`]*)`", problem)
        assert commands == [f"uv lock --default-index {kernel_index}"], problem

        # Run the advice as written (plus the test's own isolation flags): the new lock is accepted.
        argv = shlex.split(commands[0])
        uv(*argv[1:], "--no-config", "--python", PYTHON)
        assert lock_problem((proj / "uv.lock").read_bytes(), kernel_index) is None
        assert any(p.startswith("/simple/hostile") for p in mirror.requests)
    finally:
        default.close()
        mirror.close()
