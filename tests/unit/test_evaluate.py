"""The metric contract and the verdict rules that submit relies on."""

from __future__ import annotations

from decimal import Decimal

import pytest

from channel.messages import EvalContract
from kernel.evaluate import (
    EvalRun,
    MetricError,
    baseline_key,
    decide,
    extract_metric,
    is_improved,
    unchanged_verdict,
)

HIGHER = EvalContract(command="python eval.py", metric="score", direction="higher")


def ok(stdout: str) -> EvalRun:
    return EvalRun(exit_code=0, stdout=stdout)


@pytest.mark.parametrize(
    ("stdout", "expected"),
    [
        ('{"score": 0.91}\n', Decimal("0.91")),
        ('{"metric": "score", "value": 3}\n', Decimal(3)),
        ('noise\n{"score": 0.5}\nmore noise\n', Decimal("0.5")),
        ('{"score": 0.1}\n{"score": 0.2}\n', Decimal("0.2")),  # the last one wins
        ('{"score": 0.7}\n{"loss": 1.5}\n{"epoch": 3}\n', Decimal("0.7")),  # later JSON without the metric
        ('  {"score": -1e-3}  \n', Decimal("-0.001")),
    ],
)
def test_extract_metric_takes_the_last_line_carrying_it(stdout: str, expected: Decimal) -> None:
    assert extract_metric(stdout, "score") == expected


@pytest.mark.parametrize(
    ("stdout", "reason"),
    [
        ("", "no line of stdout"),
        ("score: 0.91\n", "no line of stdout"),  # no regex fallback
        ('{"score": NaN}\n', "not a finite number"),
        ('{"score": Infinity}\n', "not a finite number"),
        ('{"score": "0.9"}\n', "not a number"),
        ('{"score": true}\n', "not a number"),
        ('{"score":\n0.9}\n', "no line of stdout"),  # not a single-line object
    ],
)
def test_extract_metric_refuses(stdout: str, reason: str) -> None:
    with pytest.raises(MetricError, match=reason):
        extract_metric(stdout, "score")


def test_floor_exactly_met_is_improved_without_float_surprises() -> None:
    contract = EvalContract(command="c", metric="score", min_delta=0.2)
    # 0.3 - 0.1 == 0.19999999999999998 in binary floats
    assert is_improved(contract, Decimal("0.1"), Decimal("0.3"))
    assert not is_improved(contract, Decimal("0.1"), Decimal("0.2999"))


def test_relative_floor_and_lower_is_better() -> None:
    contract = EvalContract(command="c", metric="loss", direction="lower", min_relative=0.1)
    assert is_improved(contract, Decimal("2.0"), Decimal("1.8"))  # exactly 10 %
    assert not is_improved(contract, Decimal("2.0"), Decimal("1.81"))
    assert not is_improved(contract, Decimal("2.0"), Decimal("2.5"))


def test_equal_values_are_not_an_improvement() -> None:
    assert not is_improved(HIGHER, Decimal(1), Decimal(1))


def test_decide_names_the_failing_side() -> None:
    v = decide(
        HIGHER,
        ok('{"score": 0.5}'),
        EvalRun(exit_code=1, stdout="Traceback", state="FAILED"),
        seed=7,
        base_commit="b",
        candidate_commit="c",
    )
    assert v.outcome == "failed"
    assert v.failed_side == "candidate"
    assert v.reason is not None
    assert "code 1" in v.reason
    v = decide(
        HIGHER, ok('{"score": NaN}'), ok('{"score": 1}'), seed=7, base_commit="b", candidate_commit="c"
    )
    assert (v.outcome, v.failed_side) == ("failed", "base")


def test_decide_reports_values_delta_and_reuse() -> None:
    v = decide(
        HIGHER,
        Decimal("0.5"),
        ok('{"score": 0.75}'),
        seed=3,
        base_commit="b",
        candidate_commit="c",
        baseline_reused=True,
    )
    assert (v.outcome, v.base_value, v.candidate_value, v.delta) == ("improved", 0.5, 0.75, 0.25)
    assert v.baseline_reused
    assert v.seed == 3


def test_unchanged_verdict() -> None:
    v = unchanged_verdict(HIGHER, "abc")
    assert v.outcome == "unchanged"
    assert v.base_commit == v.candidate_commit == "abc"


def _key(**over: object) -> str:
    args: dict[str, object] = {
        "base_tree": "t1",
        "contract": HIGHER,
        "seed": 1,
        "jail": "bwrap",
        "image": None,
        "gpus": 0,
        "backend": "local",
    }
    args.update(over)
    return baseline_key(**args)  # type: ignore[arg-type]


def test_baseline_key_changes_with_anything_that_determines_the_measurement() -> None:
    key = _key()
    assert key == _key()
    variants = [
        _key(base_tree="t2"),
        _key(contract=EvalContract(command="python eval.py --fast", metric="score")),
        _key(contract=EvalContract(command="python eval.py", metric="acc")),
        _key(seed=2),
        _key(jail="apptainer"),
        _key(image="img.sif"),
        _key(gpus=1),
        _key(backend="slurm"),
    ]
    assert key not in variants
    assert len(set(variants)) == len(variants)
