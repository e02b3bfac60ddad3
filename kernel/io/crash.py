"""TEST ONLY crash injection: every point where a test may SIGKILL the kernel, in one place.

`SYSCALL_KERNEL_CRASH_AT=<step>` makes the kernel kill itself with SIGKILL (as a power cut or the OOM killer
would) when it reaches that step, so the fault tests prove that a restart finishes the work exactly once.
The executor's steps are `CRASH_STEPS`; the Slurm backend adds `SLURM_CRASH_STEPS`.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Final

from kernel.io import log as klog

CRASH_ENV: Final = "SYSCALL_KERNEL_CRASH_AT"
# recorded: dispatch entered (sleep recorded, nothing done); snapshot: snapshot recorded; submit: every launch
# handed to the backend, job ids not yet recorded; task_end: a task's end recorded while others still run;
# gathered: the wake recorded, no wake file written.
CRASH_STEPS: Final = ("recorded", "snapshot", "submit", "task_end", "gathered")
# sbatch: sbatch answered, the job id not yet recorded anywhere (tests/integration/test_e2e_slurm.py).
SLURM_CRASH_STEPS: Final = ("sbatch",)


def crash_point(step: str) -> None:
    """TEST ONLY: die here, as a SIGKILL would, when SYSCALL_KERNEL_CRASH_AT names this step."""
    assert step in CRASH_STEPS or step in SLURM_CRASH_STEPS, step
    if os.environ.get(CRASH_ENV) == step:
        klog.event("crash_injected", logging.WARNING, step=step)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)
