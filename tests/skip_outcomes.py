"""Every outcome of the prompt skipper's sampling design with its exact probability, written
independently of :func:`grpo_parts.core.inclusion.systematic_sample` (which tests/skip/test_prompt_skip.py
checks against it).

The design: the ``D`` drawn prompts in a uniformly random order (each order ``1 / D!``) are intervals
of length ``p_i`` laid end to end on ``[0, S)``; a uniform ``U`` keeps every prompt whose interval
``[a, b)`` holds a point ``U + j`` (``j >= 0``, ``U + j < S``). The count of such points is
``ceil(b - U) - ceil(a - U)``, constant in ``U`` between the fractional parts of the edges, so each
order contributes one outcome per piece of ``[0, 1)`` between them (its length is its probability).
"""

from __future__ import annotations

import itertools
import math

Outcome = frozenset[int]


def systematic_outcomes(p: list[float]) -> dict[Outcome, float]:
    """Kept positions -> probability, over every order and every piece of ``U``."""
    n = len(p)
    out: dict[Outcome, float] = {}
    orders = list(itertools.permutations(range(n)))
    for order in orders:
        edges = [0.0, *itertools.accumulate(p[i] for i in order)]
        total = edges[-1]
        cuts = sorted({0.0, 1.0, *(e - math.floor(e) for e in edges)})
        for lo, hi in zip(cuts, cuts[1:]):
            if hi - lo <= 0:
                continue
            u = 0.5 * (lo + hi)
            kept = set()
            for k, i in enumerate(order):
                a, b = edges[k], min(edges[k + 1], total)
                if math.ceil(b - u) - math.ceil(a - u) >= 1:
                    kept.add(i)
            key = frozenset(kept)
            out[key] = out.get(key, 0.0) + (hi - lo) / len(orders)
    return out


def marginals(outcomes: dict[Outcome, float], n: int) -> list[float]:
    return [sum(prob for s, prob in outcomes.items() if i in s) for i in range(n)]
