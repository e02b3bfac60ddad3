"""`syscall-kernel check` (issue 12, defect 8): a misspelled partition, a glob matching nothing, a state dir
that cannot be made, all found before the first sleep; a good config passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernelproc import ROOT, Kernel, git_workspace


def check(config: Path, env: dict[str, str] | None = None) -> tuple[int, list[dict[str, str]]]:
    done = subprocess.run(
        [sys.executable, "-m", "kernel.cli", "check", "--json", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def levels(findings: list[dict[str, str]]) -> dict[str, str]:
    return {f["what"]: f["level"] for f in findings}


def test_check_passes_a_good_config_and_names_what_is_wrong_with_a_broken_one(tmp_path: Path) -> None:
    agents = tmp_path / "agents"
    git_workspace(agents / "run-1")
    k = Kernel(tmp_path, f'workspaces = ["{agents}/*"]\njail = "none"\n')
    rc, found = check(k.config)
    assert rc == 0, found
    assert levels(found)["state_dir"] == "ok"
    assert any("matches 1 directory" in f["detail"] for f in found)

    broken = tmp_path / "broken.toml"
    (tmp_path / "a-file").write_text("")
    broken.write_text(f'state_dir = "{tmp_path / "a-file"}"\nworkspaces = ["{tmp_path}/agentz/*"]\n')
    rc, found = check(broken)
    assert rc == 1
    got = levels(found)
    assert got["state_dir"] == "error"
    assert got["workspaces"] == "warn"
    assert any("matches nothing" in f["detail"] for f in found)
    if os.geteuid() == 0:
        assert got["user"] == "error"  # no allow_root

    # A running kernel holds the lock: check says so, and changes nothing.
    k.start()
    try:
        assert k.proc is not None
        rc, found = check(k.config)
        assert rc == 0
        assert any(f["what"] == "lock" and str(k.proc.pid) in f["detail"] for f in found)
        assert k.stop() == 0
    finally:
        k.ensure_stopped()


def test_check_says_when_the_open_file_limit_cannot_hold_every_workspace(tmp_path: Path) -> None:
    """One fd per served channel (its lock): a hard limit below the workspaces' count is an error, named with the
    fix; the inotify watch limit is reported beside it."""
    import resource

    agents = tmp_path / "agents"
    for i in range(60):
        git_workspace(agents / f"w{i:02d}")
    k = Kernel(tmp_path, f'workspaces = ["{agents}/*"]\njail = "none"\n')
    rc, found = check(k.config)
    assert rc == 0, found
    assert levels(found)["fds"] == "ok"
    assert levels(found)["inotify"] in ("ok", "warn")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))  # < 60 + FD_MARGIN

    done = subprocess.run(
        [sys.executable, "-m", "kernel.cli", "check", "--json", "--config", str(k.config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=low_limit,
    )
    found = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 1
    fds = next(f for f in found if f["what"] == "fds")
    assert fds["level"] == "error"
    assert "60 workspaces" in fds["detail"]
    assert "LimitNOFILE" in fds["detail"]


@pytest.mark.slurm
def test_check_asks_slurm_about_the_partition(tmp_path: Path, slurm_conf: Path) -> None:
    k = Kernel(tmp_path, 'backend = "slurm"\njail = "none"\n[slurm]\npartition = "gpu-typo"\n')
    rc, found = check(k.config, {"SLURM_CONF": str(slurm_conf)})
    assert rc == 1
    [part] = [f for f in found if f["what"] == "slurm.partition"]
    assert part["level"] == "error"
    assert "'gpu-typo' is not known to Slurm" in part["detail"]
    real = (
        subprocess.run(
            ["scontrol", "show", "--oneliner", "partition"],
            capture_output=True,
            text=True,
            env={**os.environ, "SLURM_CONF": str(slurm_conf)},
            check=True,
        )
        .stdout.split()[0]
        .split("=")[1]
    )
    k.config.write_text(k.config.read_text().replace("gpu-typo", real))
    rc, found = check(k.config, {"SLURM_CONF": str(slurm_conf)})
    assert rc == 0, found
    assert levels(found)["slurm.partition"] == "ok"
