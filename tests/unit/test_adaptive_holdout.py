"""bench/adaptive_holdout.py on a fixed seed (pure logic, fast): with `exact` disclosure an adaptive agent's
apparent private gain outgrows anything evaluation noise explains while its fresh gain stays about 0; with
`ladder` and `thresholdout` the apparent gain stays within the mode's stated bound."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "adaptive_holdout.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("adaptive_holdout", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["adaptive_holdout"] = module
    spec.loader.exec_module(module)
    return module


def params(bench: ModuleType) -> object:
    return bench.Params(
        n=4000, k=3000, flip=1 / 64, step=0.005, threshold=0.015, noise=0.0005, budget=8, seed=7
    )


def test_exact_values_let_the_agent_fit_the_private_set(bench: ModuleType) -> None:
    p = params(bench)
    c = bench.simulate("exact", p)
    noise_only = bench.ladder_bound(p, 0) - p.step / 2  # how far k non-adaptive evaluations go by chance
    assert c.apparent[-1] > 1.5 * noise_only
    assert c.apparent[-1] > 5 * max(abs(v) for v in c.fresh)
    assert c.apparent == c.private  # exact: what the verdict says is the private gain
    # the fresh gain stays at the noise of one evaluation of the kept candidate
    assert max(abs(v) for v in c.fresh) < noise_only


@pytest.mark.parametrize("mode", ["ladder", "thresholdout"])
def test_the_apparent_gain_stays_within_the_stated_bound(bench: ModuleType, mode: str) -> None:
    p = params(bench)
    c = bench.simulate(mode, p)
    exact = bench.simulate("exact", p)
    assert c.bound is not None
    assert max(c.apparent) <= c.bound
    assert c.releases >= 1  # the mode did disclose something: the bound is not met by silence alone
    assert max(c.apparent) < exact.apparent[-1] / 3


def test_the_ladder_bound_grows_with_the_new_bests_not_the_submits(bench: ModuleType) -> None:
    p = params(bench)
    more = bench.Params(**{**p.__dict__, "k": p.k * 100})
    assert bench.ladder_bound(more, 3) - bench.ladder_bound(p, 3) < 0.05
    assert bench.ladder_bound(p, 10) > bench.ladder_bound(p, 3)


def test_the_svg_has_a_line_per_curve(bench: ModuleType) -> None:
    p = bench.Params(n=500, k=200, seed=3)
    text = bench.svg([bench.simulate(m, p) for m in bench.MODES], p)
    assert text.startswith("<svg")
    assert text.rstrip().endswith("</svg>")
    assert text.count("<polyline") == 6
