"""The verdict's arithmetic on repeated pairs: pure, no I/O, deterministic.

A submit with `repeats = N` measures base and candidate N times, pair i both with seed i. Each pair gives a gain
(candidate - base, or base - candidate when lower is better). The candidate is `improved` only when

1. the mean gain is positive and meets every floor (`min_delta` absolute, `min_relative` times |mean base|;
   floors are inclusive), and
2. for N >= 3, a one-sided test on the gains clears zero at the contract's `confidence`:
   - `sign`: the exact sign test. Of the n gains that are not zero, k are positive; the p-value is
     P(X >= k) for X ~ Binomial(n, 1/2), computed exactly as a fraction; it clears when p <= 1 - confidence.
     (n = 0, every pair tied, gives p = 1.) With N = 9 at 0.95 this needs 8 positive gains of 9.
   - `bootstrap`: the expanded percentile bootstrap lower bound of the mean gain, taken at the two-sided
     level: BOOTSTRAP_RESAMPLES resamples of the N gains with replacement, drawn from a generator seeded by the
     caller (the same inputs always give the same bound), and a low quantile of their means; it clears when the
     bound is above zero. The quantile is Hesterberg's (2015) "expanded" one, Phi(-sqrt(N / (N - 1)) *
     t_{level, N - 1}), which widens the plain percentile interval (too narrow for few pairs: with N = 9 at 0.95
     it called 11% of no-gain tables improved) to the width of a t interval, and `level` is
     1 - (1 - confidence) / 2, the lower end of the two-sided `confidence` interval (0.0072 at N = 9, 0.95).
     Property: the bound is conservative; with no real gain its false-positive rate is about
     (1 - confidence) / 2 for symmetric gains (and a paired gain with no real gain is symmetric: swapping the
     two sides of a pair flips its sign). Measured at N = 9, 0.95 (bench/paired_rates.py): 2.35-3.0% over
     three sets of 2,000 tables, 3 and 6 of the issue's 200; with a gain of three noise widths, 199 or 200 of
     200 and 2,000 of 2,000 improved.
     Why not the one-sided level: a percentile or bootstrap-t bound's one-sided coverage error at small N is
     O(N^-1/2) or O(N^-1) and of unknown sign (Hall 1988), and even one calibrated to exactly 5% (measured
     over 2,000 tables: the one-sided expanded bound 4.9%, a bootstrap-t bound 4.9%, an exact sign-flip
     randomization test 4.5-5.2%) calls more than 5% of a given 200 tables improved about four times in ten
     by binomial chance alone (the one-sided expanded bound: 14 of the issue's 200, the sign-flip test 11).
     The two-sided level keeps "at most 1 - confidence" true with margin, as the sign test's discreteness does
     for it (1.95% at N = 9).

For N < 3 no test is possible (a sign test on two pairs cannot reach p <= 0.25), so the floors alone decide;
the verdict then shows no bound.

Power (what a contract can reach, checked before it is used: kernel.core.evaluate.contract_problem and
contract_warnings): the sign test's smallest p-value over N pairs is 1/2^N (every pair favours the candidate), so
a contract whose 1/2^N is above 1 - confidence can never say `improved` (`sign_min_p`, `repeats_needed`); the
contract text says how many of the N pairs must favour the candidate (`sign_needed`). The bootstrap's bound over
few pairs is the lowest of the resampled means (`bootstrap_is_minimum`), about the smallest gain, so it passes
whenever every gain is positive: with no real gain that happens with probability 1/2^N.

Values are decimals as the metric line wrote them (kernel.core.evaluate), so a floor of 0.2 is met by 0.3 - 0.1.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from math import comb
from typing import Final, Literal

Direction = Literal["higher", "lower"]
TestKind = Literal["sign", "bootstrap"]

MIN_PAIRS_FOR_TEST: Final = 3
BOOTSTRAP_RESAMPLES: Final = 4000


def sign_test_p(gains: Sequence[Decimal]) -> Fraction:
    """The exact one-sided sign-test p-value of 'the gains are positive more often than not'."""
    nonzero = [g for g in gains if g != 0]
    n = len(nonzero)
    if n == 0:
        return Fraction(1)
    return upper_tail(n, sum(1 for g in nonzero if g > 0))


def upper_tail(n: int, k: int) -> Fraction:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly."""
    return Fraction(sum(comb(n, j) for j in range(k, n + 1)), 2**n)


def sign_min_p(n: int) -> Fraction:
    """The smallest one-sided p-value the sign test can give over `n` pairs: all `n` favour the candidate."""
    return Fraction(1, 2**n)


def alpha_of(confidence: Decimal | float) -> Fraction:
    """1 - confidence, exactly as the contract wrote it (0.95 -> 1/20)."""
    return 1 - Fraction(str(confidence))


def sign_needed(n: int, confidence: Decimal | float) -> int | None:
    """How many of `n` untied pairs must favour the candidate for the sign test to pass at `confidence` (None:
    not even all `n` do)."""
    alpha = alpha_of(confidence)
    for k in range(n + 1):
        if upper_tail(n, k) <= alpha:
            return k
    return None


def repeats_needed(confidence: Decimal | float) -> int:
    """The fewest pairs with which the sign test can pass at `confidence` (1/2^N <= 1 - confidence)."""
    alpha = alpha_of(confidence)
    n = MIN_PAIRS_FOR_TEST
    while sign_min_p(n) > alpha:
        n += 1
    return n


def bootstrap_is_minimum(n: int, confidence: Decimal | float) -> bool:
    """Whether the bootstrap bound over `n` pairs is the lowest of the BOOTSTRAP_RESAMPLES resampled means (its
    quantile is below one resample): with so few pairs the bound is about the smallest gain."""
    return int(expanded_tail(n, float(confidence)) * BOOTSTRAP_RESAMPLES) == 0


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer `df` >= 1 (Abramowitz & Stegun 26.7.3 and 26.7.4, exact sums)."""
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:
        term, total = c, 0.0
        if df > 1:
            total = term
            for k in range(3, df - 1, 2):
                term *= (k - 1) / k * c * c
                total += term
        a = 2 / math.pi * (theta + s * total)
    else:
        term, total = 1.0, 1.0
        for k in range(2, df - 1, 2):
            term *= (k - 1) / k * c * c
            total += term
        a = s * total
    return (1 + a) / 2


def student_t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p, by bisection (monotone cdf)."""
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expanded_tail(n: int, confidence: float) -> float:
    """The lower-tail probability of the bootstrap bound for n pairs (n >= 2): the expanded percentile
    bootstrap's, at the two-sided level 1 - (1 - confidence) / 2 (see the module docstring)."""
    t = student_t_quantile(1 - (1 - confidence) / 2, n - 1)
    return 0.5 * math.erfc(math.sqrt(n / (n - 1)) * t / math.sqrt(2))


def bootstrap_lower_bound(gains: Sequence[Decimal], confidence: Decimal, rng_seed: int) -> Decimal:
    """The expanded percentile bootstrap lower bound of the mean gain, two-sided level (deterministic in
    `rng_seed`).

    Resampled in binary floats (the bound is a statistic, not a value compared against a floor)."""
    if len(gains) < 2:
        raise ValueError("the bootstrap needs at least two gains")
    rng = random.Random(rng_seed)
    values = [float(g) for g in gains]
    n = len(values)
    means = sorted(math.fsum(rng.choices(values, k=n)) / n for _ in range(BOOTSTRAP_RESAMPLES))
    # the lower `tail` quantile: the largest index i with i / B <= tail
    index = int(expanded_tail(n, float(confidence)) * BOOTSTRAP_RESAMPLES)
    return Decimal(repr(means[min(max(index, 0), BOOTSTRAP_RESAMPLES - 1)]))


@dataclass(frozen=True, slots=True)
class PairedResult:
    improved: bool
    mean_base: Decimal
    mean_candidate: Decimal
    mean_gain: Decimal  # in the contract's direction: positive = better
    floors_met: bool
    p_value: Fraction | None = None  # the sign test's, N >= 3
    lower_bound: Decimal | None = None  # the bootstrap's lower bound of the mean gain, N >= 3
    test_passed: bool | None = None  # None: N < 3, no test ran


def gain_of(direction: Direction, base: Decimal, candidate: Decimal) -> Decimal:
    return candidate - base if direction == "higher" else base - candidate


def judge_pairs(
    pairs: Sequence[tuple[Decimal, Decimal]],
    *,
    direction: Direction,
    min_delta: Decimal | None,
    min_relative: Decimal | None,
    confidence: Decimal,
    test: TestKind,
    rng_seed: int,
) -> PairedResult:
    """The paired decision over (base, candidate) values, one pair per seed."""
    if not pairs:
        raise ValueError("no pairs to judge")
    n = len(pairs)
    mean_base = sum((b for b, _ in pairs), Decimal(0)) / n
    mean_cand = sum((c for _, c in pairs), Decimal(0)) / n
    gains = [gain_of(direction, b, c) for b, c in pairs]
    mean_gain = sum(gains, Decimal(0)) / n
    floors = mean_gain > 0
    if floors and min_delta is not None and mean_gain < min_delta:
        floors = False
    if floors and min_relative is not None and mean_gain < min_relative * abs(mean_base):
        floors = False
    if n < MIN_PAIRS_FOR_TEST:
        return PairedResult(floors, mean_base, mean_cand, mean_gain, floors)
    if test == "sign":
        p = sign_test_p(gains)
        passed = p <= 1 - Fraction(str(confidence))
        return PairedResult(
            floors and passed, mean_base, mean_cand, mean_gain, floors, p_value=p, test_passed=passed
        )
    bound = bootstrap_lower_bound(gains, confidence, rng_seed)
    passed = bound > 0
    return PairedResult(
        floors and passed, mean_base, mean_cand, mean_gain, floors, lower_bound=bound, test_passed=passed
    )
