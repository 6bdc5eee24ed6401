"""Exact outcome distributions of the dppo filter's sampling designs, and the expected gradient over
them: what tests/core/test_unbiased.py proves unbiasedness with.

Written independently of the filter's sampler: Bernoulli sampling is a product of independent
coins; systematic sampling in a random order is enumerated over every order (each ``1 / m!``) and
every piece of ``U in [0, 1)`` on which the picked set is constant.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from fractions import Fraction

import torch

Outcome = frozenset[int]


def bernoulli_outcomes(p: list[float]) -> dict[Outcome, float]:
    """Every subset of rows with its probability ``prod p_i^z_i (1 - p_i)^(1 - z_i)`` (zeros left out)."""
    out: dict[Outcome, float] = {}
    for z in itertools.product((0, 1), repeat=len(p)):
        prob = math.prod(pi if zi else 1.0 - pi for pi, zi in zip(p, z))
        if prob > 0:
            out[frozenset(i for i, zi in enumerate(z) if zi)] = prob
    return out


def systematic_outcomes(p: list[float]) -> dict[Outcome, float]:
    """Systematic PPS sampling in a uniformly random order of the rows with ``0 < p < 1`` (rows with
    ``p >= 1`` always in): for each order, the rows are intervals of length ``p_i`` laid end to end
    on ``[0, K)``, and the points ``U + j`` (``j < K``) pick the row whose interval holds them."""
    sure = frozenset(i for i, pi in enumerate(p) if pi >= 1.0)
    frac = [i for i, pi in enumerate(p) if 0.0 < pi < 1.0]
    k = round(sum(p[i] for i in frac))
    if k == 0:
        return {sure: 1.0}
    out: dict[Outcome, float] = {}
    orders = list(itertools.permutations(frac))
    for order in orders:
        edges = list(itertools.accumulate(p[i] for i in order))
        cuts = sorted({0.0, 1.0, *(e - math.floor(e) for e in edges)})
        for lo, hi in zip(cuts, cuts[1:]):
            if hi - lo <= 0:
                continue
            u = 0.5 * (lo + hi)
            picked = {order[min(bisect.bisect_right(edges, u + j), len(order) - 1)] for j in range(k)}
            key = sure | frozenset(picked)
            out[key] = out.get(key, 0.0) + (hi - lo) / len(orders)
    return out


def outcomes_for(sampling: str, p: torch.Tensor) -> dict[Outcome, float]:
    probs = [float(x) for x in p]
    return systematic_outcomes(probs) if sampling == "systematic" else bernoulli_outcomes(probs)


def marginals(outcomes: dict[Outcome, float], n: int) -> list[float]:
    return [sum(prob for s, prob in outcomes.items() if i in s) for i in range(n)]


#: ``grads(kept rows, weights or None) -> (loss, [grad, ...])`` of one outcome
GradFn = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, list[torch.Tensor]]]


def expected(
    outcomes: dict[Outcome, float], weights_of: Callable[[torch.Tensor], torch.Tensor | None], fn: GradFn
):
    """``sum_S P(S) * (loss_S, grads_S)`` over the outcomes (kept rows ascending)."""
    loss: torch.Tensor | None = None
    grads: list[torch.Tensor] | None = None
    total = Fraction(0)
    for s, prob in outcomes.items():
        kept = torch.tensor(sorted(s), dtype=torch.long)
        value, g = fn(kept, weights_of(kept))
        loss = prob * value if loss is None else loss + prob * value
        grads = [prob * x for x in g] if grads is None else [a + prob * x for a, x in zip(grads, g)]
        total += Fraction(prob)
    assert abs(float(total) - 1.0) < 1e-12, f"outcome probabilities sum to {float(total)}"
    assert loss is not None and grads is not None
    return loss, grads
