"""Slurm job ids in every form the clients print, parsed into one shape.

`sbatch`, `squeue` and `sacct` write the same job in different ways: `123` (a job), `123_4` (task 4 of array job
123), `123_[2-7%2]` and `123_[1,3,5-6]` (array tasks not yet split off, with an optional throttle), `123+1` (a
heterogeneous job component) and `123;cluster` (multi-cluster `sbatch --parsable`). The kernel tracks a task as
`(array job id, task index)`, so every form is reduced to a base id and the task indices it covers.
"""

from __future__ import annotations

import re
from typing import Final

from msgspec import Struct

from kernel.backends.slurm.errors import SlurmOutputError

# Slurm's MaxArraySize cannot exceed 4,000,001; a larger expansion means the text is not what we think it is.
MAX_EXPANDED_TASKS: Final = 4_000_001

_ID_RE: Final = re.compile(
    r"^(?P<base>\d+)"
    r"(?:\+(?P<het>\d+))?"
    r"(?:_(?:(?P<task>\d+)|\[(?P<ranges>[0-9,\-]+)(?:%(?P<throttle>\d+))?\]))?"
    r"(?:;(?P<cluster>[^;\s]+))?$"
)


class JobId(Struct, frozen=True):
    """One id as printed by a Slurm client.

    `tasks` is None for a job that is not an array task; otherwise the array indices the id covers (one for
    `123_4`, several for a pending range). `throttle` is the `%K` of a pending range.
    """

    base: str
    tasks: tuple[int, ...] | None = None
    throttle: int | None = None
    het_offset: int | None = None
    cluster: str | None = None


def expand_ranges(text: str) -> tuple[int, ...]:
    """`1,3,5-6` -> (1, 3, 5, 6). Also accepts a trailing `%K` throttle, which it ignores."""
    body = text.split("%", 1)[0]
    out: list[int] = []
    for part in body.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmOutputError(f"bad array index range {part!r} in {text!r}")
        start, end = int(lo), int(hi) if sep else int(lo)
        if end < start:
            raise SlurmOutputError(f"array index range {part!r} in {text!r} runs backwards")
        if len(out) + (end - start + 1) > MAX_EXPANDED_TASKS:
            raise SlurmOutputError(f"array index ranges {text!r} cover more than {MAX_EXPANDED_TASKS} tasks")
        out.extend(range(start, end + 1))
    return tuple(out)


def parse_job_id(text: str) -> JobId:
    """Parse any printed job id form; raise SlurmOutputError naming the text otherwise."""
    m = _ID_RE.match(text.strip())
    if m is None:
        raise SlurmOutputError(f"not a Slurm job id: {text!r}")
    tasks: tuple[int, ...] | None = None
    if m["task"] is not None:
        tasks = (int(m["task"]),)
    elif m["ranges"] is not None:
        tasks = expand_ranges(m["ranges"])
    return JobId(
        base=m["base"],
        tasks=tasks,
        throttle=int(m["throttle"]) if m["throttle"] else None,
        het_offset=int(m["het"]) if m["het"] else None,
        cluster=m["cluster"],
    )
