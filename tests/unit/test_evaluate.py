"""The metric contract and the verdict rules that submit relies on."""

from __future__ import annotations

import json
from decimal import Decimal

import msgspec
import pytest

from channel.decode import RequestError, decode_request
from channel.messages import EvalContract, Launch, Policy, Rejected, SleepRequest, Submit, encode
from channel.safefs import Identity
from kernel.core.budget import Balance
from kernel.core.config import ConfigError, parse
from kernel.core.evaluate import (
    EVAL_BASE,
    EVAL_CANDIDATE,
    EvalRun,
    MetricError,
    baseline_key,
    contract_problem,
    decide,
    extract_metric,
    hook_payload,
    seed_commitment,
    unchanged_verdict,
)
from kernel.core.records import WorkspaceRow
from kernel.core.rules import accept_sleep

HIGHER = EvalContract(command="python eval.py", metric="score", direction="higher")


def ok(stdout: str) -> EvalRun:
    return EvalRun(exit_code=0, stdout=stdout)


def is_improved(contract: EvalContract, base: Decimal, candidate: Decimal) -> bool:
    """One pair judged through `decide` (the candidate prints its value as the metric line)."""
    v = decide(
        contract,
        [base],
        [ok(f'{{"{contract.metric}": {candidate}}}')],
        seeds=(1,),
        base_tree="t",
        base_commit="b",
        candidate_commit="c",
        trusted=False,
    )
    return v.outcome == "improved"


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
        [ok('{"score": 0.5}')],
        [EvalRun(exit_code=1, stdout="Traceback", state="FAILED")],
        seeds=(7,),
        base_tree="t",
        base_commit="b",
        candidate_commit="c",
        trusted=False,
    )
    assert v.outcome == "failed"
    assert v.failed_side == "candidate"
    assert v.reason is not None
    assert "code 1" in v.reason
    v = decide(
        HIGHER,
        [ok('{"score": NaN}')],
        [ok('{"score": 1}')],
        seeds=(7,),
        base_tree="t",
        base_commit="b",
        candidate_commit="c",
        trusted=False,
    )
    assert (v.outcome, v.failed_side) == ("failed", "base")


def test_decide_reports_values_delta_and_reuse() -> None:
    v = decide(
        HIGHER,
        [Decimal("0.5")],
        [ok('{"score": 0.75}')],
        seeds=(3,),
        base_tree="t",
        base_commit="b",
        candidate_commit="c",
        trusted=True,
        baseline_reused=True,
    )
    assert (v.outcome, v.base_value, v.candidate_value, v.delta) == ("improved", 0.5, 0.75, 0.25)
    assert v.baseline_reused
    assert v.trusted
    assert v.seed_commitment == seed_commitment((3,), "t")
    assert "3" not in [str(x) for x in msgspec.structs.asdict(v).values()]


def test_unchanged_verdict() -> None:
    v = unchanged_verdict(HIGHER, "abc")
    assert v.outcome == "unchanged"
    assert v.base_commit == v.candidate_commit == "abc"
    v = unchanged_verdict(HIGHER, "abc", "def")  # another commit of the same tree
    assert (v.base_commit, v.candidate_commit, v.base_value) == ("abc", "def", None)


NOW = "2026-11-30T12:00:00.000Z"
GPU_CONTRACT = EvalContract(command="sh eval.sh", metric="score", eval_minutes=20, gpus=1)


def _ws(contract: EvalContract | None, gpu_s: int = 36000) -> WorkspaceRow:
    policy = Policy(submit=contract)
    return WorkspaceRow(
        "w-1", "/w", Identity(1, 2, 3), Balance(10, 5, gpu_s), policy, "sha", "inotify", NOW, None
    )


def _submit(*launches: Launch, minutes: int | None = None) -> SleepRequest:
    return SleepRequest(
        protocol=1, id="s1", launches=launches, submit=Submit(report="r", eval_minutes=minutes)
    )


def test_a_submit_adds_two_evaluation_rows_charged_like_launches_but_no_launch() -> None:
    acc = accept_sleep(_ws(GPU_CONTRACT), (), _submit(Launch(name="a", command="x")), 1, NOW)
    rows = {j.launch: j for j in acc.jobs}
    assert set(rows) == {"a", EVAL_BASE, EVAL_CANDIDATE}
    for name in (EVAL_BASE, EVAL_CANDIDATE):
        j = rows[name]
        assert (j.command, j.minutes, j.gpus, j.reserved_gpu_s, j.state) == (
            "sh eval.sh",
            20,
            1,
            1200,
            "PENDING",
        )
    # one launch and one sleep; 2 x 20 GPU-minutes reserved
    assert acc.balance == Balance(9, 4, 36000 - 2400, 2400)


def test_the_agents_eval_minutes_override_the_contracts() -> None:
    acc = accept_sleep(_ws(GPU_CONTRACT), (), _submit(minutes=5), 1, NOW)
    assert [(j.minutes, j.reserved_gpu_s) for j in acc.jobs] == [(5, 300), (5, 300)]


def test_a_submit_short_of_gpu_time_is_refused_and_costs_nothing() -> None:
    with pytest.raises(RequestError) as e:
        accept_sleep(_ws(GPU_CONTRACT, gpu_s=2399), (), _submit(), 1, NOW)
    assert (e.value.code, e.value.path) == ("budget.gpu_hours", "$.submit")


def test_a_launch_may_not_take_an_evaluation_runs_name_in_a_submitting_sleep() -> None:
    """A stage-4 rule (spec 4.0.1, 4.5.2): the decoder refuses it, before policy and kernel state."""
    refused = decode_request(encode(_submit(Launch(name=EVAL_BASE, command="x"))), "s1")
    assert isinstance(refused, Rejected)
    assert (refused.error.code, refused.error.path) == ("launch.name.duplicate", "$.launches[0].name")
    # without a submit the name is free
    req = SleepRequest(protocol=1, id="s1", launches=(Launch(name=EVAL_BASE, command="x"),))
    assert decode_request(encode(req), "s1") == req
    assert [j.launch for j in accept_sleep(_ws(GPU_CONTRACT), (), req, 1, NOW).jobs] == [EVAL_BASE]


def test_a_submit_without_a_contract_is_refused_by_policy() -> None:
    with pytest.raises(RequestError) as e:
        accept_sleep(_ws(None), (), _submit(), 1, NOW)
    assert e.value.code == "policy.submit_disabled"


@pytest.mark.parametrize(
    ("contract", "field", "problem"),
    [
        (EvalContract(command=" ", metric="score"), "command", "the eval command is empty"),
        (EvalContract(command="", metric="score"), "command", "length >= 1"),
        (EvalContract(command="x" * 2001, metric="score"), "command", "length <= 2000"),
        (EvalContract(command="c", metric="value"), "metric", "reserved keys"),
        (EvalContract(command="c", metric="a b"), "metric", "matching regex"),
        (EvalContract(command="c", metric="m" * 65), "metric", "matching regex"),
        (EvalContract(command="c", metric="score", eval_minutes=0), "eval_minutes", ">= 1"),
        (EvalContract(command="c", metric="score", eval_minutes=7 * 24 * 60 + 1), "eval_minutes", "<= 10080"),
        (EvalContract(command="c", metric="score", gpus=-1), "gpus", ">= 0"),
        (EvalContract(command="c", metric="score", gpus=65), "gpus", "<= 64"),
        (EvalContract(command="c", metric="score", min_delta=-0.1), "min_delta", ">= 0"),
        (EvalContract(command="c", metric="score", min_delta=float("inf")), "min_delta", "<="),
        (EvalContract(command="c", metric="score", min_relative=float("nan")), "min_relative", ">= 0"),
    ],
)
def test_contract_problems_name_the_field(contract: EvalContract, field: str, problem: str) -> None:
    found = contract_problem(contract)
    assert found is not None
    assert found[0] == field
    assert problem in found[1]
    assert contract_problem(HIGHER) is None
    assert contract_problem(EvalContract(command="c", metric="val/top-1.acc", min_delta=0.0)) is None


@pytest.mark.parametrize(
    ("line", "key", "problem"),
    [
        ("command = ''", "defaults.submit.command", "length >= 1"),
        ("command = '" + "x" * 2001 + "'", "defaults.submit.command", "length <= 2000"),
        ("command = '  '", "defaults.submit.command", "the eval command is empty"),
        ("metric = 'top 1'", "defaults.submit.metric", "matching regex"),
        ("metric = 'metric'", "defaults.submit.metric", "reserved keys"),
        ("eval_minutes = 0", "defaults.submit.eval_minutes", ">= 1"),
        ("eval_minutes = 20000", "defaults.submit.eval_minutes", "<= 10080"),
        ("gpus = 65", "defaults.submit.gpus", "<= 64"),
        ("min_delta = -0.5", "defaults.submit.min_delta", ">= 0"),
        ("min_delta = inf", "defaults.submit.min_delta", "<="),
        ("min_relative = nan", "defaults.submit.min_relative", ">= 0"),
    ],
)
def test_a_bad_defaults_submit_is_refused_at_load_with_the_key_named(
    line: str, key: str, problem: str
) -> None:
    fields = {"command": "command = 'python eval.py'", "metric": "metric = 'score'"}
    fields[line.split(" ", 1)[0]] = line
    text = "[defaults.submit]\n" + "\n".join(fields.values()) + "\n"
    with pytest.raises(ConfigError) as e:
        parse(text, "site.toml")
    assert str(e.value).startswith(f"site.toml: key '{key}'")
    assert problem in str(e.value)
    good = parse("[defaults.submit]\ncommand = 'sh e.sh'\nmetric = 'score'\nmin_delta = 0\n", "site.toml")
    assert good.defaults.submit == EvalContract(command="sh e.sh", metric="score", min_delta=0.0)


def test_the_hook_payload_is_one_json_object_with_the_verdict_and_report() -> None:
    v = decide(
        HIGHER,
        [Decimal("0.5")],
        [ok('{"score": 0.75}')],
        seeds=(3,),
        base_tree="t",
        base_commit="b",
        candidate_commit="c",
        trusted=False,
    )
    payload = hook_payload("w-1", "/w", "s1", 4, v, 'a "quoted"\nreport')
    got = json.loads(payload)
    assert got["verdict"]["outcome"] == "improved"
    assert (got["workspace"], got["path"], got["sleep"], got["seq"]) == ("w-1", "/w", "s1", 4)
    assert got["report"] == 'a "quoted"\nreport'
    assert payload.endswith(b"}\n")


def _key(**over: object) -> str:
    args: dict[str, object] = {
        "base_tree": "t1",
        "contract": HIGHER,
        "jail": "bwrap",
        "image": None,
        "gpus": 0,
        "backend": "local",
        "workspace": "ws-a",
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
        _key(contract=EvalContract(command="python eval.py", metric="score", seed=False)),
        _key(contract=EvalContract(command="python eval.py", metric="score", score="python3 /s/score.py")),
        _key(contract=EvalContract(command="python eval.py", metric="score", protected=("eval.py",))),
        _key(contract=EvalContract(command="python eval.py", metric="score", repeats=3)),
        _key(jail="apptainer"),
        _key(image="img.sif"),
        _key(gpus=1),
        _key(backend="slurm"),
        _key(workspace="ws-b"),
        _key(workspace=None),
    ]
    assert key not in variants
    assert len(set(variants)) == len(variants)
