"""Submit's pure core: the metric contract, the verdict, and the baseline-reuse key.

The metric contract: an eval prints its result as the LAST single-line JSON object on stdout that carries the
metric, either `{"<metric>": 0.91}` or `{"metric": "<metric>", "value": 0.91}`. Other lines (and other JSON
objects) are ignored. A nonzero exit, no such line, or a non-finite value is an eval failure, never a number.
There is deliberately no regex fallback: an eval that wants a verdict prints the line.

Values are compared as decimals parsed from the JSON text itself, so a floor written as 0.2 in the config is met
by 0.3 - 0.1 exactly (binary floats would say 0.19999999999999998).

With a `score` stage the metric is read from the score's stdout only (the agent's `command` prints whatever it
likes); without one, from `command`'s stdout, and when the contract protects paths the metric line must appear
exactly once (a second one means something besides the protected eval printed it: an `atexit` hook, an import).

Also here, pure: the evaluation job rows a sleep with a submit records at acceptance (`eval_jobs`: `repeats` tasks
each of `EVAL_BASE` / `EVAL_CANDIDATE`, reserved like launches by `ledger.reserve_eval`), the operator's contract check
(`contract_problem`), whether a contract's verdict can be trusted (`is_trusted`), the seed commitment, and the
hook's payload (`hook_payload`). The paired arithmetic is `kernel.core.paired`; the stateful side is
`kernel.io.submit`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Final, Literal

import msgspec

from channel import limits as L
from channel.messages import (
    EvalContract,
    Pair,
    SidePath,
    Submit,
    Verdict,
    VerdictRules,
    encode,
)
from kernel.core import ledger, paired
from kernel.core.records import JobRow

Side = Literal["base", "candidate"]

# The evaluation runs are job rows of the sleep under these launch names (the decoder refuses a launch that
# takes one in a sleep that carries a submit: stage 4, `launch.name.duplicate`).
EVAL_LAUNCHES: Final = L.EVAL_LAUNCH_NAMES
EVAL_BASE: Final = EVAL_LAUNCHES[0]
EVAL_CANDIDATE: Final = EVAL_LAUNCHES[1]


class MetricError(Exception):
    """Why an eval's output yields no metric value."""


@dataclass(frozen=True, slots=True)
class EvalRun:
    """What one run of one side produced: `command`'s exit code and stdout (or why it never ran to the end) and,
    with a `score` stage, the scorer's exit code and stdout (None: the scorer never ran)."""

    exit_code: int | None
    stdout: str
    state: str = "COMPLETED"
    score_code: int | None = None
    score_stdout: str | None = None


def to_decimal(x: float | int | str) -> Decimal:
    """A config number as the decimal it was written as (0.2 -> Decimal('0.2'), not the binary float)."""
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)


def _reject_constant(name: str) -> Any:
    raise MetricError(f"the metric line holds {name}, which is not a finite number")


def metric_lines(stdout: str, metric: str) -> int:
    """How many single-line JSON objects on stdout carry `metric` (well-formed or not as values)."""
    count = 0
    for line in stdout.splitlines():
        text = line.strip()
        if not (text.startswith("{") and text.endswith("}")):
            continue
        try:
            obj = json.loads(text, parse_float=Decimal, parse_int=Decimal, parse_constant=lambda _: None)
        except (ValueError, InvalidOperation):
            continue
        if isinstance(obj, dict) and (metric in obj or (obj.get("metric") == metric and "value" in obj)):
            count += 1
    return count


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


def measure(run: EvalRun, contract: EvalContract) -> Decimal:
    """The value one run measured, or MetricError saying why there is none."""
    metric = contract.metric
    if run.state != "COMPLETED" and run.exit_code is None:
        raise MetricError(f"the eval ended as {run.state} without an exit code")
    if run.exit_code != 0:
        raise MetricError(f"the eval exited with code {run.exit_code} ({run.state})")
    if contract.score is not None:
        if run.score_code is None or run.score_stdout is None:
            raise MetricError("the operator's score command did not run to the end")
        if run.score_code != 0:
            raise MetricError(f"the operator's score command exited with code {run.score_code}")
        return extract_metric(run.score_stdout, metric)
    if contract.protected and metric_lines(run.stdout, metric) > 1:
        raise MetricError(
            f"the metric {metric!r} was printed more than once; with protected files only the protected eval "
            "may print it, so another line came from code the candidate controls"
        )
    return extract_metric(run.stdout, metric)


SELF_REPORTED_WARNING: Final = (
    "the eval contract lets the candidate print its own metric (no `score` command, and `protected` does not "
    "cover every file `command` runs, or jail = 'none'): its verdicts are marked self-reported"
)


def is_trusted(contract: EvalContract, jail: str) -> bool:
    """Whether the contract's number is out of the candidate's reach: it comes from the operator's `score` stage,
    or from `command` with every file of the tree protected (`**`: nothing the candidate wrote can run), and
    the jobs run in a real jail (with `jail = "none"` the candidate's processes can reach everything)."""
    return (contract.score is not None or "**" in contract.protected) and jail != "none"


def seed_commitment(seeds: Sequence[int], base_tree: str) -> str:
    """sha256 hex of the base tree and the seeds (`<tree>:<s1>,<s2>,...`): shown to the agent in place of the
    seeds, checkable by the operator against `eval_plans` (kernel.io.submit)."""
    text = f"{base_tree}:{','.join(str(s) for s in seeds)}"
    return hashlib.sha256(text.encode()).hexdigest()


def _floor(x: float | None) -> Decimal | None:
    return None if x is None else to_decimal(x)


def decide(
    contract: EvalContract,
    base: Sequence[EvalRun] | Sequence[Decimal],
    candidate: Sequence[EvalRun],
    *,
    seeds: Sequence[int],
    base_tree: str,
    base_commit: str,
    candidate_commit: str,
    trusted: bool,
    baseline_reused: bool = False,
    seeds_from_seq: int | None = None,
    protected_changed: tuple[str, ...] = (),
    shadows_removed: tuple[tuple[SidePath, ...], int] = ((), 0),
    scorer_unseen: tuple[tuple[SidePath, ...], int] = ((), 0),
) -> Verdict:
    """The verdict of a paired evaluation: run i of each side is pair i (seed i). `base` holds Decimals when a
    stored measurement with the same seeds was reused. `shadows_removed` and `scorer_unseen` are (the first
    paths, how many in all) that the nodes left out of the sides' trees (Verdict says what each means)."""
    common: dict[str, Any] = {
        "metric": contract.metric,
        "direction": contract.direction,
        "min_delta": contract.min_delta,
        "min_relative": contract.min_relative,
        "baseline_reused": baseline_reused,
        "seeds_from_seq": seeds_from_seq,
        "base_commit": base_commit,
        "candidate_commit": candidate_commit,
        "trusted": trusted,
        "seed_commitment": seed_commitment(seeds, base_tree) if seeds else None,
        "repeats": len(candidate),
        "protected_changed": protected_changed,
        "shadows_removed": shadows_removed[0],
        "shadows_removed_count": shadows_removed[1],
        "scorer_unseen": scorer_unseen[0],
        "scorer_unseen_count": scorer_unseen[1],
    }
    if len(base) != len(candidate):
        return Verdict(
            outcome="failed",
            failed_side="base",
            reason=f"{len(base)} base values for {len(candidate)} candidate runs",
            **common,
        )
    values: dict[Side, list[Decimal]] = {"base": [], "candidate": []}
    sides: tuple[tuple[Side, Sequence[EvalRun | Decimal]], ...] = (("base", base), ("candidate", candidate))
    for side, runs in sides:
        for i, run in enumerate(runs):
            if isinstance(run, Decimal):
                values[side].append(run)
                continue
            try:
                values[side].append(measure(run, contract))
            except MetricError as exc:
                where = f" (pair {i + 1} of {len(runs)})" if len(runs) > 1 else ""
                return Verdict(outcome="failed", failed_side=side, reason=f"{exc}{where}", **common)
    pairs = list(zip(values["base"], values["candidate"], strict=True))
    r = _judge(contract, pairs, seeds, base_tree)
    tested = r.test_passed is not None
    return Verdict(
        outcome="improved" if r.improved else "not_improved",
        base_value=float(r.mean_base),
        candidate_value=float(r.mean_candidate),
        delta=float(r.mean_candidate - r.mean_base),
        pairs=tuple(Pair(base=float(b), candidate=float(c), delta=float(c - b)) for b, c in pairs),
        test=contract.test if tested else None,
        confidence=contract.confidence if tested else None,
        p_value=None if r.p_value is None else float(r.p_value),
        lower_bound=None if r.lower_bound is None else float(r.lower_bound),
        **common,
    )


def public_estimate(
    contract: EvalContract,
    base: Sequence[EvalRun] | Sequence[Decimal],
    candidate: Sequence[EvalRun],
    *,
    seeds: Sequence[int],
    base_tree: str,
) -> tuple[float, bool] | None:
    """Thresholdout's public estimate (kernel.core.disclosure): with a score stage, the (mean gain, improved) that
    the sides' own `command` output gives (the metric line each run printed on data the candidate sees), judged
    like the private pairs; None when there is no score stage, the base was reused (its runs' output is not
    kept), or a run printed no metric line."""
    if contract.score is None or len(base) != len(candidate) or not candidate:
        return None
    pairs = []
    runs: Sequence[EvalRun | Decimal] = base
    for b, c in zip(runs, candidate, strict=True):
        if not isinstance(b, EvalRun):
            return None
        try:
            pairs.append(
                (extract_metric(b.stdout, contract.metric), extract_metric(c.stdout, contract.metric))
            )
        except MetricError:
            return None
    r = _judge(contract, pairs, seeds, base_tree)
    return float(r.mean_gain), r.improved


def _judge(
    contract: EvalContract, pairs: list[tuple[Decimal, Decimal]], seeds: Sequence[int], base_tree: str
) -> paired.PairedResult:
    """The contract's paired decision (the bootstrap seeded by the seed commitment: the same inputs, the same
    bound)."""
    return paired.judge_pairs(
        pairs,
        direction=contract.direction,
        min_delta=_floor(contract.min_delta),
        min_relative=_floor(contract.min_relative),
        confidence=to_decimal(contract.confidence),
        test=contract.test,
        rng_seed=int(seed_commitment(seeds, base_tree)[:16], 16),
    )


def unchanged_verdict(
    contract: EvalContract,
    base_commit: str,
    candidate_commit: str | None = None,
    *,
    trusted: bool = False,
    sleep_refunded: bool = True,
) -> Verdict:
    """The candidate's tree equals the base's: nothing is run or charged (the sleep too, when it carried
    nothing but the submit)."""
    return Verdict(
        outcome="unchanged",
        metric=contract.metric,
        direction=contract.direction,
        min_delta=contract.min_delta,
        min_relative=contract.min_relative,
        base_commit=base_commit,
        candidate_commit=base_commit if candidate_commit is None else candidate_commit,
        trusted=trusted,
        repeats=contract.repeats,
        reason=None
        if sleep_refunded
        else "the sleep's own launches ran and were charged as usual; the evaluation was not",
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
    "score": "score-command",
    "score_data": "score-data",
    "score_from": "score-from",
    "protected": "protected",
    "repeats": "repeats",
    "confidence": "confidence",
    "test": "test",
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
    if c.score is not None and not c.score.strip():
        return "score", "the score command is empty"
    if c.score is None and c.score_data is not None:
        return "score_data", "private score data needs a `score` command to read it (`command` never sees it)"
    if c.score is None and c.score_from == "base":
        return (
            "score_from",
            '"base" names where the `score` command comes from, but there is no score command',
        )
    if c.score_data is not None and os.path.normpath(c.score_data) == "/":
        return "score_data", "'/' cannot be the private score data directory"
    if c.score is not None and c.score_data is not None and os.path.normpath(c.score_data) in c.score:
        return "score", (
            f"name the private data as $SCORE_DATA, not {c.score_data!r}: the score stage mounts it at a path drawn "
            "for each run, so that no symlink the candidate leaves in its tree can point at it "
            '(e.g. score = "python3 $SCORE_DATA/score.py")'
        )
    return _power_problem(c)


def _power_problem(c: EvalContract) -> tuple[str, str] | None:
    """A sign-test contract that can never say `improved`: its smallest p-value is above 1 - confidence."""
    n = c.repeats
    if c.test != "sign" or n < paired.MIN_PAIRS_FOR_TEST or paired.sign_needed(n, c.confidence) is not None:
        return None
    smallest = paired.sign_min_p(n)
    need = paired.repeats_needed(c.confidence)
    return "repeats", (
        f"with repeats = {n} the sign test can never pass at confidence {c.confidence:g}: its smallest p-value "
        f"(all {n} pairs favour the candidate) is 1/{smallest.denominator} = {float(smallest):g}, above "
        f"1 - confidence = {float(paired.alpha_of(c.confidence)):g}; use repeats >= {need}, or confidence <= "
        f"{float(1 - smallest):g} (or repeats <= 2, where no test runs and the floors alone decide)"
    )


def contract_warnings(c: EvalContract) -> list[str]:
    """What an operator should know about a contract that can be used: a bootstrap over too few pairs to mean
    anything. (A self-reported contract is SELF_REPORTED_WARNING, which needs the jail.)"""
    out = []
    n = c.repeats
    if (
        c.test == "bootstrap"
        and n >= paired.MIN_PAIRS_FOR_TEST
        and paired.bootstrap_is_minimum(n, c.confidence)
    ):
        chance = float(paired.sign_min_p(n))
        alpha = float(paired.alpha_of(c.confidence))
        over = f", above 1 - confidence = {alpha:g}" if chance > alpha else ""
        out.append(
            f"the bootstrap over repeats = {n} pairs at confidence {c.confidence:g} has too few pairs to mean "
            "anything: its bound is the lowest of the resampled means, about the smallest gain, so it passes "
            f"whenever all {n} gains are positive, which with no real gain happens with probability "
            f'1/{2**n} = {chance:g}{over}; use repeats >= {_bootstrap_needed(c.confidence)} or test = "sign"'
        )
    return out


def disclosure_warning(c: EvalContract, rules: VerdictRules) -> str | None:
    """A disclosure mode that cannot hide the private value: without a score stage the metric line is in the
    runs' own output, which the wake's task tails show."""
    if rules.disclosure == "exact" or c.score is not None:
        return None
    return (
        f"[verdicts] disclosure = {rules.disclosure!r} withholds the verdict's values, but this contract has no "
        "`score` command: the eval command prints the metric into the runs' output, which the wake's task tails "
        "show (and the candidate's code computes it on data the agent has)"
    )


def _bootstrap_needed(confidence: float) -> int:
    n = paired.MIN_PAIRS_FOR_TEST
    while paired.bootstrap_is_minimum(n, confidence):
        n += 1
    return n


def eval_jobs(
    contract: EvalContract, submit: Submit, workspace: str, seq: int, now: str
) -> tuple[JobRow, ...]:
    """The base and candidate evaluation rows of a sleep (`repeats` tasks each), PENDING, each reserving its GPU
    time."""
    minutes = submit.eval_minutes or contract.eval_minutes
    return tuple(
        JobRow(
            workspace=workspace,
            seq=seq,
            launch=name,
            task=task,
            array_size=contract.repeats,
            concurrency=0,
            command=contract.command,
            minutes=minutes,
            gpus=contract.gpus,
            artifacts=(),
            why="",
            reserved_gpu_s=ledger.task_reservation(contract.gpus, minutes),
            state="PENDING",
            updated_at=now,
        )
        for name in EVAL_LAUNCHES
        for task in range(contract.repeats)
    )


def hook_payload(workspace: str, path: str, sleep_id: str, seq: int, verdict: Verdict, report: str) -> bytes:
    """What `on_verdict` reads on stdin: one JSON object."""
    head = json.dumps({"workspace": workspace, "path": path, "sleep": sleep_id, "seq": seq, "report": report})
    return head[:-1].encode() + b', "verdict": ' + encode(verdict).rstrip(b"\n") + b"}\n"


def baseline_key(
    *,
    base_tree: str,
    contract: EvalContract,
    jail: str,
    image: str | None,
    gpus: int,
    backend: str,
    workspace: str | None,
) -> str:
    """Everything that determines a baseline measurement but its seeds, hashed. A stored measurement with this
    key is reused together with its own seeds (the candidate then runs with them), so reuse holds only for the
    same seeds.

    `base_tree` is the id the kernel's own repository computed (never one read from the agent's `.git`);
    `workspace` binds the measurement to the workspace that made it (None: shared, `share_baselines`)."""
    parts = {
        "workspace": workspace,
        "base_tree": base_tree,
        "command": contract.command,
        "metric": contract.metric,
        "seed_policy": contract.seed,
        "score": contract.score,
        "score_data": contract.score_data,
        "score_from": contract.score_from,
        "protected": list(contract.protected),
        "repeats": contract.repeats,
        "jail": jail,
        "image": image,
        "gpus": gpus,
        "backend": backend,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
