"""An adaptive agent against a fixed private set: what each `[verdicts] disclosure` mode lets it believe.

The setting of Blum & Hardt's boosting attack and Dwork et al.'s reusable holdout, with no signal at all: the
labels are fair coins, so every candidate's true gain over the base is exactly 0. A candidate is a vector of
predictions over three sets of `n` examples each: the private set the verdict scores (the operator's scorer),
a fresh set nobody ever scores (what the candidate would do on new data), and a public set the agent has
labels for (what its own `command` prints: thresholdout's public estimate). The base is a random vector.

The agent starts from the base and, `k` times, flips each prediction of its current candidate with probability
`flip`, submits the result, and keeps it when the verdict praises it:
- exact: when the shown gain (the exact private gain) is above the best shown so far;
- ladder: when the verdict is `improved` (a new best by at least a step);
- thresholdout: when the shown gain (public, or private plus noise) is above the best shown so far.
The verdict is made by the kernel's own code (kernel.core.disclosure.ladder and .thresholdout).

Recorded after every submit: the apparent gain (what the verdicts say of the kept candidate) and its gain on the
fresh set. With `exact` the apparent gain grows while the fresh gain stays about 0; `bound` is what each mode
guarantees (see `ladder_bound` and `thresholdout_bound`), and the apparent gain stays under it.

    .venv/bin/python bench/adaptive_holdout.py [--n 10000] [--k 2000] [--seed 26] [--svg docs/adaptive_holdout.svg]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from kernel.core import disclosure as D

MODES = ("exact", "ladder", "thresholdout")
DELTA = 0.05  # the bounds hold with probability at least 1 - DELTA


@dataclass(frozen=True)
class Params:
    n: int = 10_000  # examples in each of the private, fresh and public sets
    k: int = 10_000  # submits
    flip: float = 1 / 128  # probability that a submit flips each prediction of the kept candidate
    step: float = 0.003  # ladder
    threshold: float = 0.01  # thresholdout T
    noise: float = 0.0005  # thresholdout sigma
    budget: int = 10  # thresholdout B
    seed: int = 26


@dataclass(frozen=True)
class Curve:
    mode: str
    apparent: list[float]  # after submit t: the gain the verdicts claim for the kept candidate
    fresh: list[float]  # after submit t: the kept candidate's gain on the fresh set
    private: list[float]  # after submit t: its exact private gain (what the operator's history shows)
    releases: int  # ladder: new bests; thresholdout: private disclosures spent
    bound: float | None  # the mode's guarantee on apparent - true gain (None: exact has none)


def _mask(rng: random.Random, n: int, flip: float) -> int:
    """n random bits, each set with probability `flip` (a power of 1/2)."""
    bits = (1 << n) - 1
    for _ in range(round(-math.log2(flip))):
        bits &= rng.getrandbits(n)
    return bits


def _gain(cand: int, base: int, labels: int, n: int) -> float:
    """(correct predictions of cand - of base) / n: mismatches are set bits of x ^ labels."""
    return (((base ^ labels).bit_count()) - ((cand ^ labels).bit_count())) / n


def ladder_bound(p: Params, releases: int) -> float:
    """The ladder's guarantee, with probability 1 - DELTA, on |shown best - true gain| after `releases` new bests.

    Given the agent's own randomness, the k candidates it submits are a function of the verdicts' transcript, and
    a ladder transcript with r new bests is fixed by their positions and their (increasing) levels: at most
    C(k, r) * C(L, r) of them, L = 1/step levels in (0, 1]. A per-example gain lies in [-1, 1], so Hoeffding gives
    P(|private - true| > eps) <= 2 exp(-n eps^2 / 2) for one candidate; a union bound over the k candidates of
    every transcript with r bests, at level DELTA / 2^(r+1) for each r, gives eps_r; the shown best is within
    step / 2 of its private gain. With r = 0 it is the bound of a single, non-adaptive evaluation of k
    candidates: how far evaluation noise alone goes."""
    levels = math.floor(1 / p.step)
    transcripts = math.log(math.comb(p.k, releases)) + math.log(math.comb(levels, min(releases, levels)))
    log_count = transcripts + math.log(p.k) + math.log(2) + (releases + 1) * math.log(2)
    eps = math.sqrt(2 * (log_count + math.log(1 / DELTA)) / p.n)
    return p.step / 2 + eps


def thresholdout_bound(p: Params, spent: int) -> float:
    """Thresholdout's stated bound on (shown - true gain) after `spent` private disclosures.

    A shown public value is within T_hat + eta of the private one, a shown private value within |xi|; the Laplace
    draws are below these tails with probability 1 - DELTA / 2 (k draws of eta at scale 4 sigma, spent + 1 of
    gamma at 2 sigma, spent of xi at sigma). What the private gains of the kept candidates owe to the private data
    is bounded as the ladder's is, with `spent` disclosures in place of new bests, each counted as one of 2 /
    sigma values (its noise's resolution). That last term is a heuristic, not a proof: the noisy values are
    continuous, and a proof goes through the transfer theorem of Dwork et al. (2015), whose constants are far
    looser. The bench checks the bound; it does not derive it."""
    tail = math.log(6 * p.k / DELTA)
    noise = 4 * p.noise * tail + 2 * p.noise * tail + p.noise * tail
    levels = math.ceil(2 / p.noise)
    transcripts = math.log(math.comb(p.k, spent)) + spent * math.log(levels)
    log_count = transcripts + math.log(p.k) + (spent + 2) * math.log(2)
    eps = math.sqrt(2 * (log_count + math.log(2 / DELTA)) / p.n)
    return p.threshold + noise + eps


def simulate(mode: str, p: Params) -> Curve:
    """One agent's k submits under `mode` (the same private, fresh and public sets for every mode)."""
    world = random.Random(p.seed)
    n = p.n
    labels = {s: world.getrandbits(n) for s in ("private", "fresh", "public")}
    base = {s: world.getrandbits(n) for s in labels}
    agent = random.Random(p.seed + 1)
    noise = random.Random(p.seed + 2)
    kept = dict(base)
    best_shown = 0.0
    state = D.State()
    apparent, fresh, private = [], [], []
    releases = 0
    for _ in range(p.k):
        cand = {s: kept[s] ^ _mask(agent, n, p.flip) for s in labels}
        gains = {s: _gain(cand[s], base[s], labels[s], n) for s in labels}
        improved = gains["private"] > 0  # repeats = 1, no floors: the floors alone decide
        if mode == "exact":
            praised, shown = gains["private"] > best_shown, gains["private"]
        elif mode == "ladder":
            out = D.ladder(
                state, gain=Decimal(repr(gains["private"])), improved=improved, step=Decimal(repr(p.step))
            )
            state = out.state
            praised, shown = out.improved, out.gain or 0.0
            releases += out.improved
        else:
            out = D.thresholdout(
                state,
                private=(gains["private"], improved),
                public=(gains["public"], gains["public"] > 0),
                threshold=p.threshold,
                noise=p.noise,
                budget=p.budget,
                rng=noise,
            )
            state = out.state
            praised = out.gain is not None and out.gain > best_shown
            shown = out.gain or 0.0
            releases = state.spent
        if praised:
            kept, best_shown = cand, shown
        apparent.append(best_shown)
        fresh.append(_gain(kept["fresh"], base["fresh"], labels["fresh"], n))
        private.append(_gain(kept["private"], base["private"], labels["private"], n))
    bound = {
        "exact": None,
        "ladder": ladder_bound(p, releases),
        "thresholdout": thresholdout_bound(p, releases),
    }
    return Curve(mode, apparent, fresh, private, releases, bound[mode])


COLOURS = {"exact": "#c0392b", "ladder": "#2471a3", "thresholdout": "#1e8449"}


def svg(curves: list[Curve], p: Params) -> str:
    """The curves as a hand-written SVG: apparent gain (solid) and fresh gain (dashed) per mode, bounds dotted."""
    width, height, left, right, top, bottom = 820, 420, 60, 200, 30, 50
    top_value = max(max(c.apparent) for c in curves) * 1.1
    top_value = max(top_value, *(c.bound or 0.0 for c in curves)) * 1.05
    low_value = min(min(min(c.fresh) for c in curves), -0.02)

    def x(t: float) -> float:
        return left + (width - left - right) * t / p.k

    def y(v: float) -> float:
        return top + (height - top - bottom) * (top_value - v) / (top_value - low_value)

    def line(values: list[float], colour: str, dash: str = "") -> str:
        stride = max(1, len(values) // 400)
        pts = " ".join(f"{x(t + 1):.1f},{y(v):.1f}" for t, v in enumerate(values) if t % stride == 0)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<polyline fill="none" stroke="{colour}" stroke-width="1.6"{extra} points="{pts}"/>'

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="13">Adaptive agent, no real signal: n = {p.n} private examples, '
        f"{p.k} submits</text>",
        f'<line x1="{left}" y1="{y(0):.1f}" x2="{width - right}" y2="{y(0):.1f}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
    ]
    for i in range(5):
        v = low_value + (top_value - low_value) * i / 4
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3f}</text>')
    for i in range(5):
        t = p.k * i / 4
        out.append(f'<text x="{x(t):.1f}" y="{height - bottom + 16}" text-anchor="middle">{int(t)}</text>')
    out.append(
        f'<text x="{(left + width - right) / 2:.0f}" y="{height - 12}" text-anchor="middle">submits</text>'
    )
    out.append(f'<text x="14" y="{top + 4}" >gain</text>')
    legend_y = top + 10
    for c in curves:
        colour = COLOURS[c.mode]
        out.append(line(c.apparent, colour))
        out.append(line(c.fresh, colour, "5,4"))
        if c.bound is not None:
            out.append(
                f'<line x1="{left}" y1="{y(c.bound):.1f}" x2="{width - right}" y2="{y(c.bound):.1f}" '
                f'stroke="{colour}" stroke-dasharray="1,3"/>'
            )
        for label, dash in ((f"{c.mode}: apparent", ""), (f"{c.mode}: fresh", "5,4")):
            extra = f' stroke-dasharray="{dash}"' if dash else ""
            lx = width - right + 10
            out.append(
                f'<line x1="{lx}" y1="{legend_y}" x2="{lx + 22}" y2="{legend_y}" stroke="{colour}" '
                f'stroke-width="1.6"{extra}/>'
            )
            out.append(f'<text x="{lx + 28}" y="{legend_y + 4}">{label}</text>')
            legend_y += 18
    out.append(
        f'<text x="{width - right + 10}" y="{legend_y + 8}" font-size="11">dotted: the mode\'s bound</text>'
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=Params.n)
    ap.add_argument("--k", type=int, default=Params.k)
    ap.add_argument("--seed", type=int, default=Params.seed)
    ap.add_argument("--svg", type=Path, help="write the curves as an SVG plot here")
    args = ap.parse_args()
    p = Params(n=args.n, k=args.k, seed=args.seed)
    curves = [simulate(m, p) for m in MODES]
    for c in curves:
        marks = sorted({p.k // 10, p.k // 4, p.k // 2, p.k} - {0})
        print(
            json.dumps(
                {
                    "mode": c.mode,
                    "n": p.n,
                    "k": p.k,
                    "seed": p.seed,
                    "releases": c.releases,
                    "bound": None if c.bound is None else round(c.bound, 4),
                    "apparent": {t: round(c.apparent[t - 1], 4) for t in marks},
                    "private": {t: round(c.private[t - 1], 4) for t in marks},
                    "fresh": {t: round(c.fresh[t - 1], 4) for t in marks},
                    "max_apparent": round(max(c.apparent), 4),
                    "max_abs_fresh": round(max(abs(v) for v in c.fresh), 4),
                }
            )
        )
    if args.svg is not None:
        args.svg.write_text(svg(curves, p))


if __name__ == "__main__":
    main()
