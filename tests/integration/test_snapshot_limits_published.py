"""The operator's `[snapshot]` limits are published where clients and agents look (issue 13 follow-up): in
`kernel.json` `limits` and `jobenv.json` `snapshot`, and `syscall env` says them before a sleep is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kernelproc import Kernel, git_workspace


def test_the_configured_snapshot_limits_are_in_kernel_json_jobenv_and_syscall_env(tmp_path: Path) -> None:
    k = Kernel(
        tmp_path,
        'backend = "none"\n[snapshot]\nmax_files = 1234\nmax_bytes = 5678901\nmax_depth = 9\n',
    )
    ws = git_workspace(tmp_path / "ws")
    k.enroll(ws)
    limits = json.loads((ws / ".syscall" / "kernel.json").read_text())["limits"]
    assert (limits["snapshot_max_files"], limits["snapshot_max_bytes"], limits["snapshot_max_depth"]) == (
        1234,
        5678901,
        9,
    )
    snap = json.loads((ws / ".syscall" / "jobenv.json").read_text())["snapshot"]
    assert (snap["max_files"], snap["max_total_bytes"], snap["max_depth"]) == (1234, 5678901, 9)
    out = subprocess.run(
        [sys.executable, str(ws / ".syscall" / "syscall"), "env"],
        cwd=ws,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert (
        "more than 1234 files, more than 5678901 bytes in all, or a path deeper than 9 directories: "
        "the sleep is refused snapshot.too_large" in out
    ), out
