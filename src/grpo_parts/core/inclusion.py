"""The one sampling design both unbiased parts draw with (:mod:`grpo_parts.filter.dppo`,
:mod:`grpo_parts.skip.draw`): keep item ``i`` with probability ``p_i = clamp(score * t, floor, 1)``,
``sum p`` a target, weighted ``1 / p_i`` (Horvitz-Thompson), by a draw that keeps each item with
exactly ``p_i`` and a fixed count. The rule that keeps the weighted loss unbiased is :mod:`.unbiased`'s.
"""

from __future__ import annotations

import math

import torch

from ..errors import GRPOPartsError

__all__ = ["inclusion_probabilities", "probabilities_for_target", "systematic_sample"]

_EPS = 1e-9


def _solve_scale(a: torch.Tensor, target: float, floor: float) -> float:
    """The ``t`` with ``f(t) = sum clamp(a * t, floor, 1) = target``, exactly: ``f`` is piecewise linear
    and non-decreasing in ``t`` with kinks at ``floor / a_i`` and ``1 / a_i``; evaluate it at every
    kink (sorted ``a`` and prefix sums, ``O(N log N)``), find the piece holding ``target`` and solve
    the linear equation on it. Needs ``floor * N < target < f(inf)``."""
    n = int(a.numel())
    srt = torch.sort(a).values
    prefix = torch.cat([a.new_zeros(1), torch.cumsum(srt, 0)])
    pos = srt[srt > 0]
    kinks = torch.unique(torch.cat([floor / pos, 1.0 / pos]))  # sorted ascending
    capped_from = torch.searchsorted(srt, 1.0 / kinks, right=False)  # rows >= this index: a * t >= 1
    floored_to = torch.searchsorted(srt, floor / kinks, right=True)  # rows < this index: a * t <= floor
    mid_sum = prefix[capped_from] - prefix[floored_to]
    values = floor * floored_to.to(a.dtype) + kinks * mid_sum + (n - capped_from).to(a.dtype)
    j = int(torch.searchsorted(values, torch.tensor([target], dtype=values.dtype)))
    j = min(j, int(kinks.numel()) - 1)
    t_lo, f_lo = (0.0, floor * n) if j == 0 else (float(kinks[j - 1]), float(values[j - 1]))
    t_hi, f_hi = float(kinks[j]), float(values[j])
    return t_hi if f_hi <= f_lo else t_lo + (target - f_lo) * (t_hi - t_lo) / (f_hi - f_lo)


def inclusion_probabilities(scores: torch.Tensor, target: float, floor: float) -> torch.Tensor:
    """``p = clamp(scores * t, floor, 1)`` with ``sum p = target`` (float64, ``[n]``). ``scores >= 0``;
    ``floor * n <= target <= n`` is reachable (a target below ``floor * n`` gives ``floor`` everywhere).
    When even ``t -> inf`` falls short (rows of score 0 stuck at the floor), the score-0 rows share what is
    left equally."""
    a = scores.detach().to(torch.float64).cpu()
    n = int(a.numel())
    if n == 0 or target >= n:
        return torch.ones(n, dtype=torch.float64)
    if target <= floor * n:
        return torch.full((n,), floor, dtype=torch.float64)
    pos = a > 0
    n_pos = int(pos.sum())
    if target >= n_pos + floor * (n - n_pos):  # every positive row capped; zeros take the rest
        p = torch.ones(n, dtype=torch.float64)
        p[~pos] = min(1.0, (target - n_pos) / (n - n_pos))
        return p
    return (a * _solve_scale(a, target, floor)).clamp(floor, 1.0)


def probabilities_for_target(raw: torch.Tensor, target: float | None, floor: float) -> torch.Tensor:
    """``raw`` (float64 ``[D]``, each in ``[floor, 1]``) scaled to sum to ``min(target, D)``:
    ``clamp(raw * t, floor, 1)`` with ``t`` solved exactly (raised, ``t >= 1``, when ``raw`` sums to
    less; lowered when to more, the floor giving way to ``target / D`` only below ``floor * D``).
    ``target=None``: ``raw`` as it is."""
    p = raw.detach().to(torch.float64).cpu()
    if target is None or p.numel() == 0:
        return p
    if target <= 0:
        raise GRPOPartsError(f"target: expected > 0 prompts, got {target}")
    return inclusion_probabilities(p, float(target), min(floor, target / p.numel(), float(p.min())))


def systematic_sample(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``[D]`` bool: systematic sampling of ``p`` (``0 <= p <= 1``) in a random order: the items,
    shuffled, are intervals of length ``p_i`` end to end on ``[0, S)``, and one uniform ``U`` keeps
    every item whose interval holds a point ``U + j`` -- probability exactly ``p_i``, whatever ``S``;
    the kept count is ``floor(S)`` or ``ceil(S)``."""
    n = int(p.numel())
    keep = torch.zeros(n, dtype=torch.bool)
    if n == 0:
        return keep
    order = torch.randperm(n, generator=generator)
    edges = torch.cumsum(p.detach().to(torch.float64).cpu()[order], 0)
    total = float(edges[-1])
    if abs(total - round(total)) < _EPS:  # a sum solved to an integer keeps exactly that many
        total = float(round(total))
    u = torch.rand((), generator=generator, dtype=torch.float64)
    points = u + torch.arange(max(1, math.ceil(total)), dtype=torch.float64)
    points = points[points < total]
    hit = torch.searchsorted(edges, points, right=True).clamp(max=n - 1)
    keep[order[hit]] = True
    return keep
