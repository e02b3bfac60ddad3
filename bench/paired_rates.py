"""How often the paired verdict says `improved`: false positives with no real gain, power with a real one.

The synthetic eval of tests/unit/test_paired.py (a side's score is its true value plus N(0, 1) noise drawn from
(seed, side)), N = 9 pairs, confidence 0.95, over several independent sets of seed tables: the issue's 200
(table t's seeds from random.Random(10_000 + t)) and sets of 2,000 from other starting integers, so a rate is
not the luck of one set. Prints one JSON line per (set, test, direction).

    .venv/bin/python bench/paired_rates.py [--tables 2000] [--starts 50000 90000 130000]
"""

from __future__ import annotations

import argparse
import json
import random
from decimal import Decimal

from kernel.core.paired import judge_pairs

N = 9


def score(true_value: float, seed: int, side: str) -> Decimal:
    rng = random.Random(f"{seed}/{side}")
    return Decimal(repr(round(true_value + rng.gauss(0.0, 1.0), 9)))


def improved(start: int, tables: int, gain: float, test: str, direction: str) -> int:
    hits = 0
    for t in range(tables):
        rng = random.Random(start + t)
        seeds = [rng.randrange(2**31) for _ in range(N)]
        cand = 10.0 + (gain if direction == "higher" else -gain)
        pairs = [(score(10.0, s, "base"), score(cand, s, "candidate")) for s in seeds]
        hits += judge_pairs(
            pairs,
            direction=direction,  # type: ignore[arg-type]
            min_delta=None,
            min_relative=None,
            confidence=Decimal("0.95"),
            test=test,  # type: ignore[arg-type]
            rng_seed=t,
        ).improved
    return hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tables", type=int, default=2000)
    ap.add_argument("--starts", type=int, nargs="*", default=[50_000, 90_000, 130_000])
    ap.add_argument("--tests", nargs="*", default=["bootstrap", "sign"])
    args = ap.parse_args()
    sets = [(10_000, 200), *((s, args.tables) for s in args.starts)]
    for start, tables in sets:
        for test in args.tests:
            for direction in ("higher", "lower"):
                fp = improved(start, tables, 0.0, test, direction)
                power = improved(start, tables, 3.0, test, direction)
                row = {"start": start, "tables": tables, "test": test, "direction": direction}
                row |= {"no_gain_improved": fp, "rate": round(fp / tables, 4), "gain3_improved": power}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
