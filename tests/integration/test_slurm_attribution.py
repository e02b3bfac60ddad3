"""Attribution on the real throwaway cluster: every job a real kernel submits says whose it is, and the `squeue`
line documented in docs/slurm.md shows it (the workspace key and sleep id in the comment, the workspace's own
account or the site's, the site's WCKey).

The cluster has no accounting database, so Slurm takes any account name as given: that is what lets one test
show both a workspace's own account and the site's. `jail = "none"`: the jail has its own tests.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from kernelproc import ROOT, Kernel, git_workspace, put_request, read_answer, wait_for

from channel.paths import workspace_key

pytestmark = pytest.mark.slurm

CONFIG = """backend = "slurm"
jail = "none"
[slurm]
account = "site-acct"
wckey = "agents"
poll_seconds = 1.0
poll_max_seconds = 2.0
"""


def documented_squeue() -> list[str]:
    """The `squeue -o` line of docs/slurm.md's Attribution section, as written there."""
    text = (ROOT / "docs" / "slurm.md").read_text()
    section = text.split("## Attribution", 1)[1].split("\n## ", 1)[0]
    [line] = re.findall(r"^squeue .*-o .*$", section, re.M)
    return shlex.split(line)


def run(conf: Path, argv: list[str]) -> str:
    env = {**os.environ, "SLURM_CONF": str(conf)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def test_squeue_shows_the_workspace_the_sleep_and_the_account(tmp_path: Path, slurm_conf: Path) -> None:
    kernel = Kernel(tmp_path, CONFIG)
    own = git_workspace(tmp_path / "own")
    site = git_workspace(tmp_path / "site")
    kernel.enroll(own, "--account", "proj-a")
    kernel.enroll(site)
    keys = {n: workspace_key(ws.resolve()) for n, ws in (("own", own), ("site", site))}
    names = [f"sk-{keys['own']}-1-hold", f"sk-{keys['site']}-1-hold"]
    launch = [{"name": "hold", "command": "sleep 600", "minutes": 15}]
    try:
        kernel.start(env={"SLURM_CONF": str(slurm_conf)})
        put_request(own, "own-1", {"protocol": 1, "id": "own-1", "type": "sleep", "launches": launch})
        put_request(site, "site-1", {"protocol": 1, "id": "site-1", "type": "sleep", "launches": launch})
        for ws, rid in ((own, "own-1"), (site, "site-1")):
            answer = wait_for(lambda ws=ws, rid=rid: read_answer(ws, rid), 60, f"the answer to {rid}")
            assert answer["type"] == "accepted", answer
        kernel.wait_log("event=submitted", 60, count=2)

        rows: dict[str, list[str]] = {}
        out = run(slurm_conf, documented_squeue())
        header, *lines = out.splitlines()
        assert header.split() == ["JOBID", "ACCOUNT", "PARTITION", "STATE", "TIME", "COMMENT"], header
        for line in lines:
            job, account, _partition, _state, _time, *comment = line.split()
            rows[" ".join(comment)] = [job, account]
        want_own = f"syscall-kernel ws={keys['own']} sleep=own-1 seq=1 launch=hold"
        want_site = f"syscall-kernel ws={keys['site']} sleep=site-1 seq=1 launch=hold"
        assert rows[want_own][1] == "proj-a", out
        assert rows[want_site][1] == "site-acct", out
        wckeys = run(slurm_conf, ["squeue", "--me", "-h", "-O", "JobID:12,WCKey:20"]).split()
        assert wckeys[wckeys.index(rows[want_own][0]) + 1] == "agents"
    finally:
        kernel.ensure_stopped()
        for name in names:
            subprocess.run(
                ["scancel", "--name", name],
                env={**os.environ, "SLURM_CONF": str(slurm_conf)},
                capture_output=True,
                timeout=60,
                check=False,
            )
