"""Every hint the wake gives is true of what happened: a table of claims, checked against every end.

For each exit kind a wrapper or backend records (kernel.core.exits.KINDS), with the scheduler's own state where
one explains the end, for a plain launch and a submit's evaluation run, and for each shape of output (stdout and
stderr empty or not, a failed import), the test builds the task as the wake shows it (`gather.task_result`, the
markdown's `render_task`) and checks every claim its hint makes against the situation that produced it: a hint
that names the stderr has a stderr to show, one that says "the walltime" belongs to a TIMEOUT, one that offers
`--mem` to a launch that can ask for it, one that says `uv add` to a failed import with uv-built environments.
A hint that makes no claim of the table checks nothing; a claim that is false for any end fails the test.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from channel import limits as L
from channel.messages import TaskResult
from channel.render import render_task
from kernel.core import exits
from kernel.core.records import JobRow
from kernel.service.gather import LogScan, TaskFiles, task_result

MAX_MEM_MB = 65536
DEFAULT_MEM_MB = 4096
MINUTES = 10  # every case's walltime


@dataclass(frozen=True)
class Case:
    kind: str
    scheduler: str | None
    launch: str
    stdout: str
    stderr: str
    mode: str  # the kernel's environment.mode
    started: bool  # the task was handed over and has a run directory
    detail: str | None

    @property
    def evaluation(self) -> bool:
        return self.launch in L.EVAL_LAUNCH_NAMES


@dataclass(frozen=True)
class Seen:
    case: Case
    task: TaskResult
    hint: str  # the markdown's `Hint:` line (the task's own hint, else the state's)


def _scan(text: str) -> LogScan | None:
    if not text:
        return None
    data = text.encode()
    return LogScan(len(data), text.count("\n"), text, len(data), text.count("\n"), None)


OUTPUTS = (
    ("", ""),
    ("epoch 1 loss 0.9\n", ""),
    ("", "Traceback (most recent call last):\nRuntimeError: CUDA error\n"),
    ("", "Traceback (most recent call last):\nModuleNotFoundError: No module named 'sklearn.linear_model'\n"),
    ("", "\n\n"),
)
SCHEDULER: tuple[str | None, ...] = (None, *exits.SCHEDULER_KINDS)


def cases() -> list[Case]:
    out = []
    for kind, scheduler, launch, (stdout, stderr), mode in itertools.product(
        sorted(exits.KINDS), SCHEDULER, ("train", L.EVAL_LAUNCH_NAMES[1]), OUTPUTS, ("uv", "none")
    ):
        details: tuple[str | None, ...] = (None,)
        if kind == "submit_failed":
            details = (None, "resubmission failed: sbatch: error: invalid partition")
        if kind in ("disk_full", "disk_limit"):
            details = (None, "the job's tree went over its 100 MB")
        out += [Case(kind, scheduler, launch, stdout, stderr, mode, True, d) for d in details]
    # tasks cancelled before they were ever handed over: no run directory, no output
    out.append(Case("cancelled", None, "train", "", "", "none", False, None))
    return out


def seen(c: Case) -> Seen:
    end = exits.outcome(c.kind, 1, "SIGTERM", scheduler=c.scheduler, detail=c.detail)  # type: ignore[arg-type]
    job = JobRow(
        "w-1", 3, c.launch, 0, 1, 0, "python train.py", MINUTES, 0, (), "", 0, end.state,
        exit_code=end.exit_code, signal=end.signal,
    )  # fmt: skip
    files = TaskFiles(stdout=_scan(c.stdout), stderr=_scan(c.stderr), hint=end.hint)
    tdir = Path("/run/task") if c.started else None
    t = task_result(job, tdir, 12.5 if c.started else None, files, c.mode, (DEFAULT_MEM_MB, MAX_MEM_MB))
    md = render_task(t)
    [line] = [x for x in md.splitlines() if x.startswith("Hint: ")] or ["Hint: "]
    return Seen(c, t, line.removeprefix("Hint: "))


def _imported(s: Seen) -> str | None:
    m = re.search(r"No module named '([^']+)'", s.case.stderr)
    return m.group(1) if m else None


# (what the hint says, what must then be true)
CLAIMS: tuple[tuple[str, Callable[[Seen], bool]], ...] = (
    (r"\bbelow\b", lambda s: False),  # a hint never points at a place in the page
    (
        r"stderr usually says why|see the stderr tail|stderr tail has",
        lambda s: bool(s.task.stderr_tail.strip()),
    ),
    (r"stdout's last lines", lambda s: bool(s.task.stdout_tail.strip())),
    (r"wrote nothing to stderr|left no message", lambda s: not s.task.stderr_tail.strip()),
    (r"printed nothing", lambda s: not (s.task.stdout_tail.strip() or s.task.stderr_tail.strip())),
    (r"walltime", lambda s: s.task.state == "TIMEOUT"),
    # an evaluation run's walltime is the submit's `eval_minutes`, else the contract's: no launch declared it
    (r"walltime you declared|ask for more minutes", lambda s: not s.case.evaluation),
    (r"eval_minutes", lambda s: s.task.state == "TIMEOUT" and s.case.evaluation),
    (r"its walltime of (\d+) minutes", lambda s: f"its walltime of {MINUTES} minutes" in s.hint),
    (r"its elapsed time says when", lambda s: s.task.elapsed_s is not None),
    (r"memory", lambda s: s.task.state == "OUT_OF_MEMORY" or "disk" in s.hint),
    (r"--mem MB", lambda s: s.task.state == "OUT_OF_MEMORY" and not s.case.evaluation),
    (rf"up to {MAX_MEM_MB} MB", lambda s: not s.case.evaluation),
    (r"a submit cannot ask for more memory", lambda s: s.case.evaluation),
    (r"uv add", lambda s: s.case.mode == "uv" and _imported(s) is not None),
    (r"could not import `([^`]+)`", lambda s: _imported(s) is not None and f"`{_imported(s)}`" in s.hint),
    (r"does not build environments from uv\.lock", lambda s: s.case.mode != "uv"),
    (r"before it started", lambda s: not s.case.started or s.case.kind == "cancelled"),
    (r"before it finished", lambda s: s.case.started),
    (r"killed by SIGTERM", lambda s: s.task.signal == 15),
    (r"outside the kernel", lambda s: False),  # only Slurm's own account says so (its hint_of)
    (r"exit(ed)? with a non-zero status", lambda s: s.task.state == "FAILED" and s.task.exit_code != 0),
    (r"your command did not run", lambda s: s.case.kind in ("environment_failed", "submit_failed")),
    (r"could not submit this task again", lambda s: s.case.kind == "submit_failed"),
    (r"resubmission failed", lambda s: s.case.detail is not None and "resubmission failed" in s.case.detail),
)

SEEN = [seen(c) for c in cases()]


@pytest.mark.parametrize("pattern", [p for p, _ in CLAIMS])
def test_every_claim_a_hint_makes_is_true_of_the_end_it_describes(pattern: str) -> None:
    holds = dict(CLAIMS)[pattern]
    false = [(s.case, s.hint) for s in SEEN if re.search(pattern, s.hint) and not holds(s)]
    assert not false, f"{len(false)} hints claim {pattern!r} untruly, e.g.:\n" + "\n".join(
        f"{c}: {h}" for c, h in false[:5]
    )


def test_every_end_that_is_not_a_success_has_a_hint() -> None:
    # Slurm's own `failed` has its hint from Slurm's account (the backend's hint_of), which this table has not.
    silent = [s.case for s in SEEN if s.task.state != "COMPLETED" and not s.hint and s.case.kind != "failed"]
    assert not silent, silent[:5]


def test_the_claims_are_exercised() -> None:
    """Each claim of the table is made by some hint (a claim no hint makes would test nothing)."""
    unused = [p for p, _ in CLAIMS if p not in (r"\bbelow\b", r"outside the kernel")]
    unused = [p for p in unused if not any(re.search(p, s.hint) for s in SEEN)]
    assert not unused, unused
