"""TEST ONLY crash and fault injection: every point where a test may SIGKILL the kernel or hang its I/O, in one place.

`SYSCALL_KERNEL_CRASH_AT=<step>` makes the kernel kill itself with SIGKILL (as a power cut or the OOM killer
would) when it reaches that step, so the fault tests prove that a restart finishes the work exactly once.
The executor's steps are `CRASH_STEPS`; the Slurm backend adds `SLURM_CRASH_STEPS`, environment builds
`ENV_CRASH_STEPS`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Final

from kernel.io import log as klog

CRASH_ENV: Final = "SYSCALL_KERNEL_CRASH_AT"
# recorded: dispatch entered (sleep recorded, nothing done); snapshot: snapshot recorded; submit: every launch
# handed to the backend, job ids not yet recorded; task_end: a task's end recorded while others still run;
# gathered: the wake recorded, no wake file written.
CRASH_STEPS: Final = ("recorded", "snapshot", "submit", "task_end", "gathered")
# A sleep's early wake (`wake_on`; tests/fault/test_wake_on_crash.py: only such a sleep reaches them):
# early_gathered: the early wake recorded, no file of it written; early_woken: its files written and the sleep
# recorded early_woken, the rest still running; rest_cancel (`rest` "cancel"): the trigger and the tasks to stop
# recorded, their cancel not sent.
WAKE_ON_CRASH_STEPS: Final = ("early_gathered", "early_woken", "rest_cancel")
# build: a locked environment's background build begun (its flock held, its builder recorded), uv not yet run
# (tests/fault/test_environment_build_crash.py: only a sleep with a uv.lock reaches it).
ENV_CRASH_STEPS: Final = ("build",)
# sbatch: sbatch answered, the job id not yet recorded anywhere (tests/integration/test_e2e_slurm.py).
SLURM_CRASH_STEPS: Final = ("sbatch",)


def crash_point(step: str) -> None:
    """TEST ONLY: die here, as a SIGKILL would, when SYSCALL_KERNEL_CRASH_AT names this step."""
    assert (
        step in CRASH_STEPS
        or step in SLURM_CRASH_STEPS
        or step in ENV_CRASH_STEPS
        or step in WAKE_ON_CRASH_STEPS
    ), step
    if os.environ.get(CRASH_ENV) == step:
        klog.event("crash_injected", logging.WARNING, step=step)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)


# A file holding "<step> <workspace path>": while it exists, that workspace's channel I/O hangs at that step.
HANG_ENV: Final = "SYSCALL_KERNEL_HANG_CHANNEL"
# channel: any channel I/O of the request path starts (open, read, write answers); listing: a full listing of
# `requests/` was made and has not returned (a huge or slow directory); refresh: the after-ready refresh of the
# kernel-written files; launches: a sleep's run directories are being written; diff: a submit's candidate tree is
# compared with its base (both heavy work of the workspace); admit: a start's admission of an enrolled channel
# (opened, owner read, locked, watched) before it is served; look: the running kernel's look at a channel it does
# not serve yet (one enrolled meanwhile, or one whose lock another process held), before it is served; glob: the
# expansion of a `workspaces` glob (named by the pattern, not a workspace path: its directory stopped answering);
# prepare: a new glob match's channel is being made and filled (enrollment); sync: the filesystem of new matches'
# channels is synced before their rows commit (named by the first workspace path on it); watch: a served channel
# is opened to watch its requests/ again (a lost watch, or one not added when it was last opened); unlock: the lock of
# a channel let go (unenrolled, taken over, held elsewhere) is closed (named by the workspace key: on a network
# filesystem that close is the server's unlock).
HANG_STEPS: Final = (
    "channel",
    "listing",
    "refresh",
    "launches",
    "diff",
    "admit",
    "look",
    "glob",
    "prepare",
    "sync",
    "watch",
    "unlock",
)


def hang_point(step: str, workspace: str) -> None:
    """TEST ONLY: the channel of `workspace` (for `glob`: the pattern; for `unlock`: the workspace key) on a
    filesystem that stopped answering. When SYSCALL_KERNEL_HANG_CHANNEL
    names a file that exists and holds "<step> <workspace path>", the calling thread blocks here (as a hung NFS
    call would) until the file is removed or names something else."""
    assert step in HANG_STEPS, step
    flag = os.environ.get(HANG_ENV)
    if not flag:
        return
    logged = False
    while True:
        try:
            held = Path(flag).read_text().strip()
        except FileNotFoundError:
            return
        if held != f"{step} {workspace}":
            return
        if not logged:
            logged = True
            klog.event("hang_injected", logging.WARNING, step=step, path=workspace)
        time.sleep(0.05)
