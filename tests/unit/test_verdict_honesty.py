"""Issue 26: contracts checked for power, verdict sentences true to what ran, what a disclosure mode shows, the
per-day bound on submits, and the disclosure state in the store."""

from __future__ import annotations

import itertools
import random
import re
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from channel.decode import RequestError
from channel.messages import EvalContract, Policy, SleepRequest, Submit, Verdict, VerdictRules
from channel.render import render_verdict
from channel.safefs import Identity
from kernel.core import disclosure as D
from kernel.core import paired
from kernel.core.budget import Balance
from kernel.core.config import ConfigError, parse
from kernel.core.evaluate import (
    EvalRun,
    contract_problem,
    contract_warnings,
    decide,
    disclosure_warning,
    unchanged_verdict,
)
from kernel.core.records import SleepRow, WorkspaceRow
from kernel.core.rules import accept_sleep, submit_window_start
from kernel.io import submit as S
from kernel.io.store import Store, timestamp

NOW = "2026-12-02T12:00:00.000Z"


def sign(repeats: int, confidence: float = 0.95, **kw: object) -> EvalContract:
    return EvalContract(command="python eval.py", metric="acc", repeats=repeats, confidence=confidence, **kw)  # type: ignore[arg-type]


# --- power ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("repeats", "smallest", "need", "highest_confidence"),
    [(3, "1/8 = 0.125", 5, "0.875"), (4, "1/16 = 0.0625", 5, "0.9375")],
)
def test_a_sign_contract_that_cannot_reach_its_confidence_is_refused(
    repeats: int, smallest: str, need: int, highest_confidence: str
) -> None:
    problem = contract_problem(sign(repeats))
    assert problem is not None
    field, why = problem
    assert field == "repeats"
    assert f"its smallest p-value (all {repeats} pairs favour the candidate) is {smallest}" in why
    assert "above 1 - confidence = 0.05" in why
    assert f"use repeats >= {need}, or confidence <= {highest_confidence}" in why
    # what the message proposes can pass
    assert contract_problem(sign(need)) is None
    assert contract_problem(sign(repeats, float(highest_confidence))) is None


def test_config_load_refuses_it_naming_the_key() -> None:
    text = "[defaults.submit]\ncommand = 'python eval.py'\nmetric = 'acc'\nrepeats = 3\n"
    with pytest.raises(ConfigError) as exc:
        parse(text, "/etc/k.toml")
    assert "key 'defaults.submit.repeats'" in str(exc.value)
    assert "1/8 = 0.125" in str(exc.value)
    # two pairs run no test at all: the floors decide, which is a contract that can pass
    parse(text.replace("repeats = 3", "repeats = 2"), "/etc/k.toml")


def test_every_contract_the_checks_let_through_can_pass_and_every_refused_one_cannot() -> None:
    for n, conf in itertools.product(range(3, 17), (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)):
        c = sign(n, conf)
        all_better = paired.judge_pairs(
            [(Decimal(0), Decimal(1))] * n,
            direction="higher",
            min_delta=None,
            min_relative=None,
            confidence=Decimal(repr(conf)),
            test="sign",
            rng_seed=1,
        )
        assert (contract_problem(c) is None) == all_better.improved, (n, conf)


def test_sign_needed_is_the_fewest_favouring_pairs_that_pass() -> None:
    for n, conf in itertools.product(range(3, 13), (0.9, 0.95, 0.99)):
        need = paired.sign_needed(n, conf)
        for k in range(n + 1):
            r = paired.judge_pairs(
                [(Decimal(0), Decimal(1))] * k + [(Decimal(1), Decimal(0))] * (n - k),
                direction="higher",
                min_delta=None,
                min_relative=Decimal(-100),
                confidence=Decimal(repr(conf)),
                test="sign",
                rng_seed=1,
            )
            assert r.test_passed == (need is not None and k >= need), (n, conf, k)
    assert paired.sign_needed(9, 0.95) == 8
    assert paired.repeats_needed(0.95) == 5


def test_a_bootstrap_over_too_few_pairs_is_warned_of() -> None:
    [warning] = contract_warnings(sign(4, test="bootstrap"))
    assert "too few pairs to mean anything" in warning
    assert "probability 1/16 = 0.0625, above 1 - confidence = 0.05" in warning
    assert "use repeats >= 5" in warning
    assert contract_warnings(sign(5, test="bootstrap")) == []
    assert contract_warnings(sign(9)) == []
    # the warning's claim: with every gain positive, the bound of 4 pairs is above zero (it is their minimum)
    bound = paired.bootstrap_lower_bound(
        [Decimal("0.1"), Decimal("0.2"), Decimal("0.3"), Decimal("0.4")], Decimal("0.95"), 7
    )
    assert bound == Decimal("0.1")


def test_a_disclosure_mode_without_a_score_stage_is_warned_of() -> None:
    ladder = VerdictRules(disclosure="ladder")
    warning = disclosure_warning(sign(5), ladder)
    assert warning is not None
    assert "no `score` command" in warning
    assert disclosure_warning(sign(5, score="python3 $SCORE_DATA/s.py"), ladder) is None
    assert disclosure_warning(sign(5), VerdictRules()) is None


def test_check_reports_the_refused_contract_of_an_enrolled_workspace_and_the_warnings(tmp_path: Path) -> None:
    from kernel.service.check import run_checks

    cfg = parse(
        f"state_dir = '{tmp_path / 'state'}'\n[defaults.submit]\ncommand = 'x'\nmetric = 'acc'\nrepeats = 4\n"
        "test = 'bootstrap'\n",
        str(tmp_path / "k.toml"),
    )
    (tmp_path / "state").mkdir()
    store = Store.open(cfg.paths.store)
    with store.transaction():  # enrolled by a kernel that did not check power
        S.set_contract(store, "w-1", sign(3))
    store.close()
    found = {(f.level, f.what): f.detail for f in run_checks(cfg)}
    assert "1/8 = 0.125" in found[("error", "workspace w-1 contract")]
    assert "too few pairs to mean anything" in found[("warn", "defaults.submit")]


# --- every verdict sentence true to what ran ----------------------------------------------------------------


def runs(*values: float) -> list[EvalRun]:
    return [EvalRun(0, f'{{"acc": {v}}}\n') for v in values]


def verdict_of(contract: EvalContract, base: list[float], cand: list[float], **kw: object) -> Verdict:
    return decide(
        contract,
        runs(*base),
        runs(*cand),
        seeds=tuple(range(1, len(cand) + 1)),
        base_tree="t" * 40,
        base_commit="b" * 40,
        candidate_commit="c" * 40,
        trusted=True,
        **kw,  # type: ignore[arg-type]
    )


def sentences(md: str) -> list[str]:
    return [ln for ln in md.splitlines() if ln and not ln.startswith("|")]


def check_truth(v: Verdict, ran: int) -> None:
    """Each sentence of the rendered verdict against what ran: `ran` pairs."""
    md = render_verdict(v)
    lines = sentences(md)
    nonzero = sum(1 for p in v.pairs if p.delta != 0)
    for ln in lines:
        if m := re.match(
            r"Sign test over (\d+) pairs(?: \((\d+) not tied; ties are left out\))?: p = ([^ ]+) ", ln
        ):
            assert int(m.group(1)) == ran == len(v.pairs)
            assert int(m.group(2) or ran) == nonzero
            assert float(m.group(3)) == pytest.approx(v.p_value, rel=1e-3)
            passed = ln.endswith(": passed.")
            assert passed == (v.p_value is not None and v.p_value <= 1 - (v.confidence or 0) + 1e-9)
            if not passed:
                assert v.outcome != "improved"
        if m := re.match(r"(\d+) pairs: too few for a test", ln):
            assert int(m.group(1)) == ran
            assert 1 < ran < paired.MIN_PAIRS_FOR_TEST
        if m := re.search(r"\(mean of (\d+)\)", ln):
            assert int(m.group(1)) == ran
        if ln.startswith("Bootstrap lower bound"):
            assert ran >= paired.MIN_PAIRS_FOR_TEST
            assert ln.endswith(": passed.") == (v.lower_bound is not None and v.lower_bound > 0)
    if ran == 0:
        assert not any(re.search(r"pairs?\b.*(test|floors)", ln) for ln in lines), md
        assert not any(
            ln.startswith(("Base:", "Candidate:", "Delta:", "Sign test", "Bootstrap")) for ln in lines
        )
    if ran < paired.MIN_PAIRS_FOR_TEST:
        assert "Sign test" not in md
        assert "Bootstrap" not in md
    if v.outcome == "improved" and v.test is not None:
        assert ": passed." in md
    assert ("Seeds: drawn fresh" in md) == (v.seed_commitment is not None and not v.baseline_reused)
    assert ("Compared on the seeds of submit #" in md) == (v.seeds_from_seq is not None)
    measured = v.outcome in ("improved", "not_improved")
    assert ("Disclosure: exact: the values shown are the private result itself." in md) == measured


def test_an_unchanged_verdict_says_nothing_ran_and_claims_no_pairs() -> None:
    for repeats in (1, 2, 3, 5, 9):
        c = sign(repeats) if repeats >= 5 or repeats < 3 else sign(repeats, 0.85)
        md = render_verdict(unchanged_verdict(c, "b" * 40, trusted=True))
        assert "too few for a test" not in md
        assert "nothing was run or charged" in md
        check_truth(unchanged_verdict(c, "b" * 40, trusted=True), ran=0)


def test_a_failed_verdict_claims_no_test() -> None:
    v = decide(
        sign(5),
        runs(0.5, 0.5, 0.5, 0.5, 0.5),
        [EvalRun(3, "boom")] * 5,
        seeds=(1, 2, 3, 4, 5),
        base_tree="t" * 40,
        base_commit="b" * 40,
        candidate_commit="c" * 40,
        trusted=True,
    )
    assert v.outcome == "failed"
    check_truth(v, ran=0)
    assert "too few for a test" not in render_verdict(v)


@pytest.mark.parametrize("test", ["sign", "bootstrap"])
def test_every_verdict_sentence_is_true_to_what_ran(test: str) -> None:
    rng = random.Random(26)
    for n in (1, 2, 3, 5, 9):
        conf = 0.85 if n in (3, 4) and test == "sign" else 0.95
        for _ in range(12):
            base = [round(rng.uniform(0, 1), 2) for _ in range(n)]
            cand = [b if rng.random() < 0.2 else round(rng.uniform(0, 1), 2) for b in base]
            v = verdict_of(sign(n, conf, test=test), base, cand)
            assert v.outcome in ("improved", "not_improved")
            check_truth(v, ran=n)
            reused = msgspec.structs.replace(v, baseline_reused=True, seeds_from_seq=4)
            check_truth(reused, ran=n)
            assert "Compared on the seeds of submit #4: its base measurement stood in" in render_verdict(
                reused
            )


def test_the_sign_sentence_counts_the_ties_it_left_out() -> None:
    v = verdict_of(sign(5), [0.5] * 5, [0.5, 0.5, 0.6, 0.7, 0.8])
    md = render_verdict(v)
    assert "Sign test over 5 pairs (3 not tied; ties are left out): p = 0.125" in md
    check_truth(v, ran=5)


# --- disclosure -------------------------------------------------------------------------------------------


def test_the_ladder_discloses_only_a_new_best_by_a_step_rounded_to_it() -> None:
    step = Decimal("0.05")
    s = D.State()
    seen = []
    for gain, improved in [("0.03", True), ("0.07", True), ("0.08", True), ("0.2", False), ("0.13", True)]:
        shown = D.ladder(s, gain=Decimal(gain), improved=improved, step=step)
        seen.append((shown.improved, shown.gain))
        s = shown.state
    assert seen == [(False, None), (True, 0.05), (False, None), (False, None), (True, 0.15)]
    assert s.best == Decimal("0.15")


def exact_verdict(delta: float, outcome: str = "improved", direction: str = "higher") -> Verdict:
    return msgspec.convert(
        {
            "outcome": outcome,
            "metric": "acc",
            "direction": direction,
            "base_value": 0.5,
            "candidate_value": 0.5 + delta,
            "delta": delta,
            "repeats": 5,
            "pairs": [{"base": 0.5, "candidate": 0.5 + delta, "delta": delta}] * 5,
            "test": "sign",
            "confidence": 0.95,
            "p_value": 0.03125,
            "trusted": True,
        },
        Verdict,
    )


def test_a_ladder_verdict_withholds_the_values_and_says_so() -> None:
    rules = VerdictRules(disclosure="ladder", ladder_step=0.05)
    shown, state = D.disclose(exact_verdict(0.123), rules, D.State(), public=None, rng=random.Random(1))
    assert (shown.outcome, shown.delta, shown.best_so_far, shown.disclosure) == (
        "improved",
        0.1,
        0.1,
        "ladder",
    )
    assert (shown.base_value, shown.candidate_value, shown.pairs, shown.p_value) == (None, None, (), None)
    md = render_verdict(shown)
    assert "Improvement: 0.1, rounded to the step: the new best so far." in md
    assert "0.123" not in md
    assert "0.623" not in md
    assert "Sign test" not in md
    again, same = D.disclose(exact_verdict(0.13), rules, state, public=None, rng=random.Random(1))
    assert (again.outcome, again.delta, same) == ("not_improved", None, state)
    assert "Not shown better than the best so far (0.1) by at least 0.05: nothing more is disclosed." in (
        render_verdict(again)
    )
    lower, _ = D.disclose(
        exact_verdict(-0.123, direction="lower"), rules, D.State(), public=None, rng=random.Random(1)
    )
    assert (lower.outcome, lower.delta) == ("improved", -0.1)


def test_thresholdout_discloses_the_private_value_only_past_the_noisy_threshold_within_its_budget() -> None:
    rules = VerdictRules(
        disclosure="thresholdout",
        thresholdout_threshold=0.05,
        thresholdout_noise=0.001,
        thresholdout_budget=2,
    )
    rng = random.Random(5)
    state = D.State()
    # the private gain agrees with the public estimate: the public one is shown, nothing spent
    shown, state = D.disclose(exact_verdict(0.02), rules, state, public=(0.01, False), rng=rng)
    assert (shown.outcome, shown.delta, shown.private_disclosed, shown.budget_left) == (
        "not_improved",
        0.01,
        False,
        2,
    )
    assert "Public estimate shown: delta 0.01" in render_verdict(shown)
    # far from it: the private value plus noise, one disclosure spent
    for left in (1, 0):
        shown, state = D.disclose(exact_verdict(0.5), rules, state, public=(0.0, False), rng=rng)
        assert (shown.outcome, shown.private_disclosed, shown.budget_left) == ("improved", True, left)
        assert shown.delta == pytest.approx(0.5, abs=0.02)
        assert shown.delta != 0.5
    # budget spent: nothing is disclosed, whatever the private value (Thresholdout halts)
    for private in (0.9, -0.9):
        shown, after = D.disclose(exact_verdict(private), rules, state, public=(0.3, True), rng=rng)
        assert (shown.outcome, shown.delta, shown.private_disclosed, after) == (
            "not_improved",
            None,
            False,
            state,
        )
        md = render_verdict(shown)
        assert "The budget of private disclosures is spent: this verdict discloses nothing" in md
        assert "0.9" not in md


def test_exact_disclosure_shows_the_verdict_as_decided() -> None:
    v = exact_verdict(0.1)
    assert D.disclose(v, VerdictRules(), D.State(), public=None, rng=random.Random(1)) == (v, D.State())


def test_the_disclosure_state_survives_a_restart_and_a_rebase_resets_only_the_ladder(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    s = Store.open(path)
    with s.transaction():
        S.put_disclosure_state(s, "w-1", D.State(Decimal("0.15"), 3, 0.021))
    s.close()
    s = Store.open(path)
    assert S.disclosure_state(s, "w-1") == D.State(Decimal("0.15"), 3, 0.021)
    assert S.disclosure_state(s, "w-2") == D.State()
    with s.transaction():
        S.rebase(s, "w-1", "c" * 40, "t" * 40)
    assert S.disclosure_state(s, "w-1") == D.State(Decimal(0), 3, 0.021)
    s.close()


# --- submits per day --------------------------------------------------------------------------------------


def ws_row(per_day: int) -> WorkspaceRow:
    policy = Policy(submit=sign(5), max_submits_per_day=per_day)
    return WorkspaceRow(
        "w-1", "/w", Identity(1, 2, 3), Balance(10, 10, 36000), policy, "sha", "inotify", NOW, None
    )


def submit_req() -> SleepRequest:
    return SleepRequest(protocol=1, id="s9", submit=Submit(report="r"))


def test_a_submit_past_the_daily_bound_is_refused_saying_when_the_next_can_be() -> None:
    with pytest.raises(RequestError) as exc:
        accept_sleep(ws_row(3), (), submit_req(), 9, NOW, (3, "2026-12-01T15:30:00.000Z"))
    assert exc.value.code == "budget.submits_per_day"
    assert (
        "at most 3 submits accepted in any 24 hours, and 3 counting toward it were accepted since 2026-12-01T15:30:00.000Z"
        in (str(exc.value))
    )
    assert "the next can be accepted from 2026-12-02T15:30:00.000Z" in str(exc.value)
    accept_sleep(ws_row(3), (), submit_req(), 9, NOW, (2, "2026-12-01T15:30:00.000Z"))
    accept_sleep(ws_row(0), (), submit_req(), 9, NOW, (300, "2026-12-01T15:30:00.000Z"))
    accept_sleep(ws_row(3), (), SleepRequest(protocol=1, id="s9"), 9, NOW, (3, "2026-12-01T15:30:00.000Z"))


def test_the_store_counts_accepted_submits_in_the_window(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "db.sqlite")
    with s.transaction():
        s.put_workspace(ws_row(3))
        submit = msgspec.json.encode(Submit(report="r"))
        judged = b'{"outcome": "improved"}'  # what of the verdict is read here: that there is one
        for seq, (state, at, sub, verdict) in enumerate(
            [
                ("woken", "2026-12-01T11:59:59.999Z", submit, judged),  # before the window
                ("woken", "2026-12-01T12:00:00.000Z", submit, judged),
                ("rejected", "2026-12-01T13:00:00.000Z", submit, None),  # ran nothing
                ("woken", "2026-12-01T14:00:00.000Z", None, None),  # no submit
                ("woken", "2026-12-01T15:00:00.000Z", submit, None),  # none of its runs ran: no verdict
                ("gathered", "2026-12-01T16:00:00.000Z", submit, None),  # the same, its wake not written yet
                ("woken", "2026-12-02T11:00:00.000Z", submit, judged),
                ("running", "2026-12-02T11:30:00.000Z", submit, None),  # its verdict still to come
            ],
            start=1,
        ):
            s.insert_sleep(SleepRow("w-1", seq, f"s{seq}", state, "", sub, at, None, verdict))
    assert s.submits_since("w-1", submit_window_start(NOW)) == (3, "2026-12-01T12:00:00.000Z")
    assert timestamp(0) == "1970-01-01T00:00:00.000Z"
    s.close()
