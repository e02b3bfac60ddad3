"""Sweeps as data (spec 4.4.6): a launch's grid, each task's values and variables, and its ranking by a metric.

- `grid`: the cartesian product of a sweep's axes, the last key varying fastest; task i runs `grid(...)[i]`.
- `sweep_problem`: the rules of a sweep a schema cannot say (a key the kernel's own variables take, duplicates,
  the grid's size against `array`), as (code, message, path).
- `variables`: what a task of a swept launch is told: `SWEEP_<KEY>` per key and `SWEEP_PARAMS` (JSON).
- `metric_of`: a task's value of a metric in its last JSON line, or why it has none. That line is job-written:
  every reading here is bounded (the line is at most `RESULT_MAX_CHARS`; its nesting is checked before parsing),
  and a duplicate key, a boolean, a string, NaN, an infinity or a number too large for a float is "no value".
- `rank`: a launch's tasks best first, then those without a value in task order.

Pure: no I/O. The kernel (gathering, `history`) and the renderer use it; the tool carries its own copy of the
rules (stdlib only) that a test keeps equal.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from channel import limits as L
from channel.messages import RankedTask, SweepAxis

Params = tuple[tuple[str, str], ...]

# A result line nested deeper than this is not read for a metric (the parser would recurse that deep).
METRIC_LINE_MAX_DEPTH: Final = 32
_NUMBER_RE: Final = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def grid_size(axes: Sequence[SweepAxis]) -> int:
    return math.prod(len(a.values) for a in axes) if axes else 0


def grid(axes: Sequence[SweepAxis]) -> list[Params]:
    """Every task's values, in task order: itertools.product, the last key varying fastest."""
    if not axes:
        return []
    keys = [a.key for a in axes]
    return [tuple(zip(keys, combo, strict=True)) for combo in itertools.product(*(a.values for a in axes))]


def axes_of(tasks: Iterable[Params]) -> tuple[SweepAxis, ...]:
    """The axes a launch's tasks' values (in task order) were made from: `grid`'s inverse."""
    keys: dict[str, dict[str, None]] = {}
    for params in tasks:
        for key, value in params:
            keys.setdefault(key, {}).setdefault(value)
    return tuple(SweepAxis(key=k, values=tuple(v)) for k, v in keys.items())


def variable(key: str) -> str:
    return "SWEEP_" + key.upper()


def variables(params: Params) -> dict[str, str]:
    """The variables of a task of a swept launch: `SWEEP_<KEY>` per key, and all of them in `SWEEP_PARAMS`."""
    if not params:
        return {}
    env = {variable(k): v for k, v in params}
    env["SWEEP_PARAMS"] = json.dumps(dict(params), separators=(",", ":"))
    return env


def same_number(a: str, b: str) -> bool:
    """Whether two values are two spellings of one number (`1e-3` and `0.001`)."""
    if not (_NUMBER_RE.fullmatch(a) and _NUMBER_RE.fullmatch(b)):
        return False
    return float(a) == float(b)


def sweep_problem(axes: Sequence[SweepAxis], array: int, at: str) -> tuple[str, str, str] | None:
    """The first rule of a launch's sweep it breaks (stage 4), as (code, message, path); None when it keeps all.
    `at` is the launch's path (`$.launches[0]`)."""
    seen: set[str] = set()
    for i, axis in enumerate(axes):
        where = f"{at}.sweep[{i}]"
        if axis.key in L.SWEEP_RESERVED_KEYS:
            return (
                "launch.sweep.key.invalid",
                f"{where}.key {axis.key!r} would set {variable(axis.key)}, which the kernel sets itself; "
                "rename the key",
                f"{where}.key",
            )
        if axis.key in seen:
            return (
                "launch.sweep.key.duplicate",
                f"{where}.key {axis.key!r} is swept twice; give each key once, with all its values",
                f"{where}.key",
            )
        seen.add(axis.key)
        for j, value in enumerate(axis.values):
            for k in range(j):
                if axis.values[k] == value or same_number(axis.values[k], value):
                    same = "" if axis.values[k] == value else f" (the same number as {axis.values[k]!r})"
                    return (
                        "launch.sweep.value.duplicate",
                        f"{where}.values[{j}] {value!r} repeats values[{k}]{same}; give each value once",
                        f"{where}.values[{j}]",
                    )
    size = grid_size(axes)
    shape = " x ".join(str(len(a.values)) for a in axes)
    if size > L.ARRAY_MAX:
        return (
            "launch.sweep.too_large",
            f"{at}.sweep makes {shape} = {size} tasks; a launch has at most {L.ARRAY_MAX}: drop values, or split "
            "the grid over several launches",
            f"{at}.sweep",
        )
    if axes and array != size:
        return (
            "launch.sweep.array_mismatch",
            f"{at}.array is {array} but its sweep makes {shape} = {size} tasks; set array to {size} (or leave "
            "it out of the tool's launch: the grid sets it)",
            f"{at}.array",
        )
    return None


# --- metrics ---------------------------------------------------------------------------------------------


def parse_rank(rank: str) -> tuple[str, bool]:
    """`val_loss` -> ("val_loss", False): lowest first; `-accuracy` -> ("accuracy", True): highest first."""
    return (rank[1:], True) if rank.startswith("-") else (rank, False)


_STRING_RE: Final = re.compile(
    r'"[^"\\]*(?:\\.[^"\\]*)*"'
)  # a JSON string (the unrolled loop: no backtracking)


def _depth_within(text: str, limit: int) -> bool:
    """Whether the brackets of `text` (outside strings) nest at most `limit` deep: checked before parsing. Counts
    first (C speed), so only a line with more than `limit` brackets outside its strings is walked."""
    if text.count("[") + text.count("{") <= limit:
        return True
    bare = _STRING_RE.sub("", text)
    if bare.count("[") + bare.count("{") <= limit:
        return True
    depth = 0
    for c in bare:
        if c in "[{":
            depth += 1
            if depth > limit:
                return False
        elif c in "]}":
            depth -= 1
    return True


class _Duplicate(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _line(result: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object of a task's last JSON line (job-written), or (None, why it is not one to read)."""
    if result is None:
        return None, "no JSON line"
    if len(result) > L.RESULT_MAX_CHARS:
        return None, "its JSON line is longer than the kernel reads"
    if not _depth_within(result, METRIC_LINE_MAX_DEPTH):
        return None, f"its JSON line nests deeper than {METRIC_LINE_MAX_DEPTH} levels"
    try:
        obj = json.loads(result, object_pairs_hook=_unique)
    except _Duplicate as e:
        return None, f"duplicate:{e}"
    except (ValueError, RecursionError):
        return None, "its JSON line does not parse"
    if not isinstance(obj, dict):
        return None, "its JSON line is not an object"
    return obj, None


def _number(value: Any) -> tuple[float | None, str | None]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, f"not a number ({_json_type(value)})"
    try:
        number = float(value)
    except OverflowError:
        return None, "a number too large for a float"
    if not math.isfinite(number):
        return None, "not a finite number"
    return number, None


def metric_of(result: str | None, key: str) -> tuple[float | None, str | None]:
    """(value, None) when `result` (a task's last JSON line, job-written) has `key` at its top level as a finite
    number; else (None, why not), the reason kernel-written and naming the key only by reference."""
    obj, why = _line(result)
    if obj is None:
        if why is not None and why.startswith("duplicate:"):
            return None, "the key appears twice in its JSON line" if why[
                10:
            ] == key else "a key appears twice"
        return None, why
    if key not in obj:
        return None, "the key is not in its JSON line"
    return _number(obj[key])


def numbers_of(result: str | None) -> dict[str, float]:
    """Every top-level member of a task's last JSON line that `metric_of` reads as a value (none for a line it
    would refuse whole): what the kernel keeps of the line for `history`'s `metric`, read then without parsing
    job-written text again."""
    obj, _ = _line(result)
    if obj is None:
        return {}
    out = {}
    for key, value in obj.items():
        number, _ = _number(value)
        if number is not None and re.search(L.METRIC_KEY_PATTERN, key) and not key.startswith("-"):
            out[key] = number
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def rank(tasks: Sequence[tuple[int, str | None]], rank_key: str) -> tuple[RankedTask, ...]:
    """`tasks` ((task index, last JSON line), ...) best first by `rank_key` (`-key`: highest first), ties in
    task order; the tasks without a value after them, in task order, each saying why."""
    key, descending = parse_rank(rank_key)
    ranked: list[tuple[float, int]] = []
    unranked: list[RankedTask] = []
    for task, result in tasks:
        value, why = metric_of(result, key)
        if value is None:
            unranked.append(RankedTask(task=task, unranked=why))
        else:
            ranked.append((value, task))
    ranked.sort(key=lambda vt: (-vt[0] if descending else vt[0], vt[1]))
    return tuple(RankedTask(task=t, value=v) for v, t in ranked) + tuple(unranked)


def best(
    tasks: Sequence[tuple[str, int, Mapping[str, float], Params]], metric: str
) -> tuple[tuple[float, str, int, Params] | None, int]:
    """The best (value, launch, task, params) of `tasks` ((launch, task, its `numbers_of`, params), ...) by
    `metric` (`-key`: highest), the first in order on a tie; and how many tasks reported it."""
    key, descending = parse_rank(metric)
    found: tuple[float, str, int, Params] | None = None
    reported = 0
    for launch, task, numbers, params in tasks:
        value = numbers.get(key)
        if value is None:
            continue
        reported += 1
        if found is None or (value > found[0] if descending else value < found[0]):
            found = (value, launch, task, params)
    return found, reported


def number_text(value: float) -> str:
    """A metric value as the wake shows it: at most 6 significant digits (the JSON line beside it is exact)."""
    return format(value, ".6g")
