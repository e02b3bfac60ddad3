"""What a verdict discloses about the private data across a workspace's submits: pure, no I/O (the state lives
in the store: kernel.io.submit.disclosure_state).

Every verdict is first decided exactly (kernel.core.evaluate.decide) and kept exactly for the operator
(`syscall-kernel history --verdicts`, the `on_verdict` hook). What the agent's wake gets is `disclose`'s:

- `exact`: the verdict as decided: the means, every pair, the p-value or bound, to full precision. Each submit
  tells the agent something about the private set, so an agent that keeps whatever scores better fits the
  private set itself (bench/adaptive_holdout.py measures it).
- `ladder` (Blum & Hardt 2015, "The Ladder"): the workspace's best disclosed improvement `best` starts at 0 (the
  base). A verdict is `improved` only when the exact verdict is and its gain (the mean improvement, positive =
  better) is at least `best + step`; it then discloses that gain rounded to the nearest multiple of `step`, which
  becomes `best`. Every other verdict is `not_improved` and discloses nothing but `best`. So whatever the agent
  submits, the transcript of k submits is fixed by the positions and levels of its r new bests: at most
  r * log2(k * levels) bits about the private set, growing with the new bests, not with the submits.
- `thresholdout` (Dwork et al. 2015, "The reusable holdout"): the private gain is compared with a public
  estimate of it (the gain the candidate's own `command` printed on both sides, data the agent sees; 0 when it
  printed none, or with no score stage). Only where they differ by more than a noisy threshold,
  |private - public| > T_hat + Lap(4 sigma) with T_hat = T + Lap(2 sigma), does the verdict disclose the private
  gain plus Lap(sigma) noise and its exact outcome; that spends one of the workspace's `budget` disclosures and
  draws T_hat anew. Otherwise it discloses the public estimate and the outcome the public pairs give. With the
  budget spent, a verdict discloses nothing (`not_improved`, no value), as Thresholdout halts there. Between disclosures the private data reaches the agent only
  through the noisy comparison (the sparse vector technique), so what it learns grows with the budget spent,
  not with the submits.

Values are gains in the contract's direction (positive = better); a verdict's `delta` is candidate - base, so
`lower is better` flips the sign when a gain is shown as a delta.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import msgspec

from channel.messages import Verdict, VerdictRules


@dataclass(frozen=True, slots=True)
class State:
    """A workspace's disclosure state: the ladder's best disclosed gain, thresholdout's spent budget and its
    current noisy threshold (None: none drawn yet)."""

    best: Decimal = Decimal(0)
    spent: int = 0
    noisy_threshold: float | None = None


@dataclass(frozen=True, slots=True)
class Shown:
    """What one verdict discloses: its outcome, the gain shown (None: nothing), whether that gain is the private
    one (thresholdout; None otherwise), and the state after it."""

    improved: bool
    gain: float | None
    state: State
    private: bool | None = None


def laplace(rng: random.Random, scale: float) -> float:
    """A draw of Laplace(0, scale): the difference of two exponentials of mean `scale`."""
    return scale * (rng.expovariate(1.0) - rng.expovariate(1.0))


def ladder(state: State, *, gain: Decimal, improved: bool, step: Decimal) -> Shown:
    """The ladder's verdict on one exact result (see the module docstring)."""
    if improved and gain >= state.best + step:
        # best is a multiple of step, so the nearest multiple of a gain >= best + step is >= best + step
        level = (gain / step).to_integral_value(rounding=ROUND_HALF_EVEN) * step
        new = State(best=level, spent=state.spent, noisy_threshold=state.noisy_threshold)
        return Shown(True, float(level), new)
    return Shown(False, None, state)


def thresholdout(
    state: State,
    *,
    private: tuple[float, bool],
    public: tuple[float, bool],
    threshold: float,
    noise: float,
    budget: int,
    rng: random.Random,
) -> Shown:
    """Thresholdout's verdict on one exact result: `private` and `public` are (gain, improved) each."""
    if state.spent >= budget:
        return Shown(False, None, state, private=False)
    t_hat = state.noisy_threshold
    if t_hat is None:
        t_hat = threshold + laplace(rng, 2 * noise)
    if abs(private[0] - public[0]) > t_hat + laplace(rng, 4 * noise):
        after = State(
            best=state.best, spent=state.spent + 1, noisy_threshold=threshold + laplace(rng, 2 * noise)
        )
        return Shown(private[1], private[0] + laplace(rng, noise), after, private=True)
    kept = State(best=state.best, spent=state.spent, noisy_threshold=t_hat)
    return Shown(public[1], public[0], kept, private=False)


def gain_of(v: Verdict) -> float:
    """An exact verdict's mean gain in its direction (positive = better)."""
    assert v.delta is not None
    return v.delta if v.direction == "higher" else -v.delta


def disclose(
    exact: Verdict,
    rules: VerdictRules,
    state: State,
    *,
    public: tuple[float, bool] | None,
    rng: random.Random,
) -> tuple[Verdict, State]:
    """The verdict the agent is shown, and the workspace's state after it. A verdict with no values (failed,
    unchanged) is shown as it is, under the mode's name, and changes nothing."""
    mode = rules.disclosure
    if mode == "exact":
        return exact, state
    marks: dict[str, Any] = {"disclosure": mode}
    if mode == "ladder":
        marks["ladder_step"] = rules.ladder_step
        marks["best_so_far"] = float(state.best)
    else:
        marks["budget_left"] = max(0, rules.thresholdout_budget - state.spent)
    if exact.outcome not in ("improved", "not_improved") or exact.delta is None:
        return msgspec.structs.replace(exact, **marks), state
    gain = gain_of(exact)
    if mode == "ladder":
        shown = ladder(
            state,
            gain=Decimal(repr(gain)),
            improved=exact.outcome == "improved",
            step=Decimal(repr(rules.ladder_step)),
        )
        marks["best_so_far"] = float(shown.state.best)
    else:
        shown = thresholdout(
            state,
            private=(gain, exact.outcome == "improved"),
            public=(0.0, False) if public is None else public,
            threshold=rules.thresholdout_threshold,
            noise=rules.thresholdout_noise,
            budget=rules.thresholdout_budget,
            rng=rng,
        )
        marks["budget_left"] = max(0, rules.thresholdout_budget - shown.state.spent)
        marks["private_disclosed"] = shown.private
    delta = None if shown.gain is None else (shown.gain if exact.direction == "higher" else -shown.gain)
    withheld = msgspec.structs.replace(
        exact,
        outcome="improved" if shown.improved else "not_improved",
        base_value=None,
        candidate_value=None,
        delta=delta,
        pairs=(),
        test=None,
        confidence=None,
        p_value=None,
        lower_bound=None,
        **marks,
    )
    return withheld, shown.state
