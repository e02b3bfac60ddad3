"""Submit's pure core: the metric contract, the verdict, and the baseline-reuse key.

The metric contract: an eval prints its result as the LAST single-line JSON object on stdout that carries the
metric, either `{"<metric>": 0.91}` or `{"metric": "<metric>", "value": 0.91}`. Other lines (and other JSON
objects) are ignored. A nonzero exit, no such line, or a non-finite value is an eval failure, never a number.
There is deliberately no regex fallback: an eval that wants a verdict prints the line.

Values are compared as decimals parsed from the JSON text itself, so a floor written as 0.2 in the config is met
by 0.3 - 0.1 exactly (binary floats would say 0.19999999999999998).

Also here, pure: the two evaluation job rows a sleep with a submit records at acceptance (`eval_jobs`, named
`EVAL_BASE` / `EVAL_CANDIDATE`, charged like launches by `charge_eval`), the operator's contract check
(`contract_problem`), and the hook's payload (`hook_payload`). The stateful side is `kernel.io.submit`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Final, Literal

import msgspec

from channel.decode import RequestError
from channel.messages import EvalContract, SleepRequest, Submit, Verdict, encode
from kernel.core.budget import Balance, gpu_hours
from kernel.core.records import JobRow

Side = Literal["base", "candidate"]

# The evaluation runs are job rows of the sleep under these launch names (an agent's launch may not take them
# in a sleep that carries a submit).
EVAL_BASE: Final = "submit-base"
EVAL_CANDIDATE: Final = "submit-candidate"
EVAL_LAUNCHES: Final = (EVAL_BASE, EVAL_CANDIDATE)


class MetricError(Exception):
    """Why an eval's output yields no metric value."""


@dataclass(frozen=True, slots=True)
class EvalRun:
    """What one side's eval produced: its exit code and stdout (or why it never ran to the end)."""

    exit_code: int | None
    stdout: str
    state: str = "COMPLETED"


def to_decimal(x: float | int | str) -> Decimal:
    """A config number as the decimal it was written as (0.2 -> Decimal('0.2'), not the binary float)."""
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)


def _reject_constant(name: str) -> Any:
    raise MetricError(f"the metric line holds {name}, which is not a finite number")


def extract_metric(stdout: str, metric: str) -> Decimal:
    """The metric value from the last single-line JSON object on stdout that carries `metric`."""
    for line in reversed(stdout.splitlines()):
        text = line.strip()
        if not (text.startswith("{") and text.endswith("}")):
            continue
        try:
            obj = json.loads(text, parse_float=Decimal, parse_int=Decimal, parse_constant=_reject_constant)
        except (ValueError, InvalidOperation):
            continue
        if not isinstance(obj, dict):
            continue
        if metric in obj:
            value = obj[metric]
        elif obj.get("metric") == metric and "value" in obj:
            value = obj["value"]
        else:
            continue
        if isinstance(value, bool) or not isinstance(value, Decimal):
            raise MetricError(f"the metric {metric!r} is {json.dumps(value)[:40]}, not a number")
        if not value.is_finite():
            raise MetricError(f"the metric {metric!r} is not a finite number")
        return value
    raise MetricError(
        f'no line of stdout is a JSON object carrying {metric!r} (print e.g. {{"{metric}": 0.91}} as the last line)'
    )


def measure(run: EvalRun, metric: str) -> Decimal:
    """The value one side measured, or MetricError saying why there is none."""
    if run.state != "COMPLETED" and run.exit_code is None:
        raise MetricError(f"the eval ended as {run.state} without an exit code")
    if run.exit_code != 0:
        raise MetricError(f"the eval exited with code {run.exit_code} ({run.state})")
    return extract_metric(run.stdout, metric)


def improvement(contract: EvalContract, base: Decimal, candidate: Decimal) -> Decimal:
    """How much better the candidate is (positive = better), in the contract's direction."""
    return candidate - base if contract.direction == "higher" else base - candidate


def is_improved(contract: EvalContract, base: Decimal, candidate: Decimal) -> bool:
    """Strictly better, and at least every configured floor (floors are inclusive)."""
    gain = improvement(contract, base, candidate)
    if gain <= 0:
        return False
    if contract.min_delta is not None and gain < to_decimal(contract.min_delta):
        return False
    return not (contract.min_relative is not None and gain < to_decimal(contract.min_relative) * abs(base))


def decide(
    contract: EvalContract,
    base: EvalRun | Decimal,
    candidate: EvalRun,
    *,
    seed: int | None,
    base_commit: str,
    candidate_commit: str,
    baseline_reused: bool = False,
) -> Verdict:
    """The verdict of a paired evaluation. `base` is a Decimal when a stored measurement was reused."""
    common: dict[str, Any] = {
        "metric": contract.metric,
        "direction": contract.direction,
        "min_delta": contract.min_delta,
        "min_relative": contract.min_relative,
        "seed": seed,
        "baseline_reused": baseline_reused,
        "base_commit": base_commit,
        "candidate_commit": candidate_commit,
    }
    sides: dict[Side, Decimal] = {}
    pairs: tuple[tuple[Side, EvalRun | Decimal], ...] = (("base", base), ("candidate", candidate))
    for side, run in pairs:
        if isinstance(run, Decimal):
            sides[side] = run
            continue
        try:
            sides[side] = measure(run, contract.metric)
        except MetricError as exc:
            return Verdict(outcome="failed", failed_side=side, reason=str(exc), **common)
    b, c = sides["base"], sides["candidate"]
    return Verdict(
        outcome="improved" if is_improved(contract, b, c) else "not_improved",
        base_value=float(b),
        candidate_value=float(c),
        delta=float(c - b),
        **common,
    )


def unchanged_verdict(
    contract: EvalContract, base_commit: str, candidate_commit: str | None = None
) -> Verdict:
    """The candidate's tree equals the base's: nothing is run or charged."""
    return Verdict(
        outcome="unchanged",
        metric=contract.metric,
        direction=contract.direction,
        min_delta=contract.min_delta,
        min_relative=contract.min_relative,
        base_commit=base_commit,
        candidate_commit=base_commit if candidate_commit is None else candidate_commit,
    )


# The `enroll` flag that sets each EvalContract field (errors name what the operator typed).
EVAL_FLAGS: Final = {
    "command": "eval-command",
    "metric": "metric",
    "direction": "direction",
    "min_delta": "min-delta",
    "min_relative": "min-relative",
    "eval_minutes": "eval-minutes",
    "gpus": "eval-gpus",
    "seed": "no-seed",
}
_AT_FIELD: Final = re.compile(r"^(?P<msg>.*?) - at `\$\.(?P<field>[a-z_]+)`$", re.S)


def contract_problem(c: EvalContract) -> tuple[str, str] | None:
    """What is wrong with an operator's contract as (field, why), None when it can be used.

    The bounds are the Struct's own (`channel.messages.EvalContract`, checked by converting it again, since a
    Struct built in code is not validated); then what a schema cannot say.
    """
    try:
        msgspec.convert(msgspec.structs.asdict(c), EvalContract)
    except msgspec.ValidationError as exc:
        m = _AT_FIELD.match(str(exc))
        if m is None:
            return "contract", str(exc)
        msg = m.group("msg")
        return m.group("field"), msg[:1].lower() + msg[1:]
    if not c.command.strip():
        return "command", "the eval command is empty"
    if c.metric in ("metric", "value"):
        return "metric", f"{c.metric!r} is one of the reserved keys metric/value of the metric line"
    return None


def eval_jobs(
    contract: EvalContract, submit: Submit, workspace: str, seq: int, now: str
) -> tuple[JobRow, JobRow]:
    """The base and candidate evaluation rows of a sleep, PENDING, each reserving its GPU time."""
    minutes = submit.eval_minutes or contract.eval_minutes
    return tuple(  # type: ignore[return-value]
        JobRow(
            workspace=workspace,
            seq=seq,
            launch=name,
            task=0,
            array_size=1,
            concurrency=0,
            command=contract.command,
            minutes=minutes,
            gpus=contract.gpus,
            artifacts=(),
            why="",
            reserved_gpu_s=contract.gpus * minutes * 60,
            state="PENDING",
            updated_at=now,
        )
        for name in EVAL_LAUNCHES
    )


def check_eval_names(req: SleepRequest) -> None:
    """RequestError when a launch takes an evaluation run's name in a sleep that carries a submit."""
    if req.submit is None:
        return
    for i, launch in enumerate(req.launches):
        if launch.name in EVAL_LAUNCHES:
            raise RequestError(
                "launch.name.duplicate",
                f"$.launches[{i}].name {launch.name!r} is the name of the submit's own evaluation run; "
                "rename the launch",
                f"$.launches[{i}].name",
            )


def charge_eval(balance: Balance, jobs: tuple[JobRow, ...]) -> Balance:
    """Reserve the evaluation runs' GPU time (refunded as measured, like a launch's); a submit costs no launch."""
    cost = sum(j.reserved_gpu_s for j in jobs)
    if cost > balance.gpu_s:
        raise RequestError(
            "budget.gpu_hours",
            f"the submit's two evaluation runs reserve {gpu_hours(cost):g} GPU-hours but only "
            f"{gpu_hours(balance.gpu_s):g} are left after the launches",
            "$.submit",
        )
    return Balance(
        launches=balance.launches,
        sleeps=balance.sleeps,
        gpu_s=balance.gpu_s - cost,
        reserved_gpu_s=balance.reserved_gpu_s + cost,
    )


def hook_payload(workspace: str, path: str, sleep_id: str, seq: int, verdict: Verdict, report: str) -> bytes:
    """What `on_verdict` reads on stdin: one JSON object."""
    head = json.dumps({"workspace": workspace, "path": path, "sleep": sleep_id, "seq": seq, "report": report})
    return head[:-1].encode() + b', "verdict": ' + encode(verdict).rstrip(b"\n") + b"}\n"


def baseline_key(
    *,
    base_tree: str,
    contract: EvalContract,
    seed: int | None,
    jail: str,
    image: str | None,
    gpus: int,
    backend: str,
) -> str:
    """Everything that determines a baseline measurement, hashed. Reuse only on an exact match."""
    parts = {
        "base_tree": base_tree,
        "command": contract.command,
        "metric": contract.metric,
        "seed_policy": contract.seed,
        "seed": seed,
        "jail": jail,
        "image": image,
        "gpus": gpus,
        "backend": backend,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
