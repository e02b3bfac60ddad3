"""A locked environment on the Slurm backend: a real kernel, the throwaway cluster, bwrap, real uv, and the local
HTTPS package index of test_environment_build_jail (127.0.0.1 only, its own CA).

The kernel builds the lock's venv once, in its run directory (`<run_dir>/envs/<key>/venv`, where the nodes see
it: here the cluster's one node is this machine); each Slurm job's jail binds it read-only at /syscall-env/venv,
nothing is built on the node, and of two tasks run one after the other the first cannot change it while the
second imports the original module and runs the package's console script.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from kernelproc import Kernel, make_workspace, run_tool
from localindex import make_tls, uv_lock
from test_environment_build_jail import PYPROJECT, PYTHON, SHARED_PROBE, Server, make_wheel
from testenv import need

from kernel.node.jail import SHARED_VENV

pytestmark = [pytest.mark.slurm, pytest.mark.bwrap, pytest.mark.slow]


def test_a_slurm_job_binds_the_venv_the_kernel_built_in_its_run_directory(
    tmp_path: Path, slurm_conf: Path, bwrap_available: None
) -> None:
    need("python3 at /usr/bin/python3", os.path.exists(PYTHON), "the jobs' interpreter")
    ca, context = make_tls(tmp_path)
    index = Server(context, make_wheel([]), index=True)
    kernel = Kernel(
        tmp_path,
        f'backend = "slurm"\njail = "bwrap"\nrescan_seconds = 2\n[environment]\npython = "{PYTHON}"\n'
        f'index_url = "{index.url}/simple"\n[slurm]\npoll_seconds = 1.0\npoll_max_seconds = 2.0\n'
        "client_timeout_seconds = 10\n",
    )
    try:
        lock = uv_lock(tmp_path, PYPROJECT, index.url, ca, PYTHON)
        files = {"pyproject.toml": PYPROJECT, "uv.lock": lock, "probe.py": SHARED_PROBE}
        ws = make_workspace(tmp_path / "spaces" / "locked", files)
        kernel.enroll(ws, "--launches", "4", "--sleeps", "4", "--gpu-hours", "1")
        kernel.start(env={"SLURM_CONF": str(slurm_conf), "SSL_CERT_FILE": str(ca), "NO_PROXY": "127.0.0.1"})
        for args in (
            ("launch", "--name", "shared", "--array", "2", "--concurrency", "1", "--", "python probe.py try"),
            ("sleep", "--wait", "--json", "--timeout", "240"),
        ):
            done = run_tool(ws, *args, timeout=250)
            assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}\n{kernel.log_text()[-3000:]}"
        two = sorted(json.loads(done.stdout)["tasks"], key=lambda t: int(t["task"]))
        assert [t["state"] for t in two] == ["COMPLETED", "COMPLETED"], two
        assert all("_" in t["job_id"] for t in two), "Slurm array jobs ran them"
        [entry] = [p.parent for p in (kernel.state / "runs" / "envs").glob("*/ready.json")]
        module = next((entry / "venv").glob("lib/python*/site-packages/hostile/__init__.py"))
        digest = hashlib.sha256(module.read_bytes()).hexdigest()
        for t in two:
            out = dict(line.split(" ", 1) for line in t["stdout_tail"].splitlines())
            assert out["prefix"] == f"{SHARED_VENV} value 42 {digest}", (out, t["stderr_tail"])
            assert out["ran"] == f"tool 42 {SHARED_VENV}/bin/python", out
            assert out["writable"] == "none", out
        first = dict(line.split(" ", 1) for line in two[0]["stdout_tail"].splitlines())
        said = [first[w] for w in ("append", "create", "remove")]
        assert set(said) <= {"refused EROFS", "refused EACCES"}, first
        assert "refused EROFS" in said, first
        assert not list(module.parent.glob("added.py"))
        assert kernel.stop() == 0
    finally:
        kernel.ensure_stopped()
        index.close()
