"""Pieces shared by the filters: the priority order (tie rule), zero-variance rows, pruning counts,
the ``extra_prompts_wanted`` estimate and the result of an empty or a filtered batch.

Priority order (the tie rule every filter and the refill trim use): rows of zero-variance groups
come last; otherwise larger ``|advantage|`` first; equal ``|advantage|`` -> lower row index first.
"""

from __future__ import annotations

import math

import torch

from ..core import group_stats
from ..types import FilterResult, ScoredBatch
from .protocol import KEPT_FRACTION, NUM_KEPT

#: guards ``floor(P * n)`` against float error (0.29 * 100 = 28.999999999999996)
_FLOOR_EPS = 1e-9


def nothing_kept(weighted: bool = False) -> FilterResult:
    """What a filter returns for an empty batch (``weighted``: with its empty ``weights``)."""
    weights = torch.zeros(0, dtype=torch.float64) if weighted else None
    return FilterResult(torch.zeros(0, dtype=torch.long), 0, {KEPT_FRACTION: 0.0, NUM_KEPT: 0.0}, weights)


def check_count_or_rate(name: str, count: int | None, pruning_rate: float | None) -> None:
    """A filter sized by a row count (``name``) or a pruning rate takes exactly one of them."""
    if (count is None) == (pruning_rate is None):
        raise ValueError(
            f"{name} / pruning_rate: expected exactly one of them, got {name}={count}, pruning_rate={pruning_rate}"
        )


def num_kept(n: int, pruning_rate: float) -> int:
    """How many of ``n`` rows a pruning rate ``P`` keeps: ``n - floor(P * n) = ceil((1 - P) * n)``
    (never more than a fraction P is pruned)."""
    return n - int(math.floor(pruning_rate * n + _FLOOR_EPS))


def zero_variance_rows(batch: ScoredBatch) -> torch.Tensor:
    """``[N]`` bool: the row's group has all-equal rewards (or a single row), by exact comparison of
    the rewards, not the advantages (a framework's ``1e-17`` advantages for such a group still count)."""
    if batch.size == 0:
        return torch.zeros(0, dtype=torch.bool, device=batch.rewards.device)
    gi = batch.group_index.long()
    _, _, _, zero_var = group_stats(batch.rewards, gi)
    return zero_var[gi]


def priority_order(batch: ScoredBatch, zero_var: torch.Tensor | None = None) -> torch.Tensor:
    """All row indices ``[N]`` from most to least worth training on (see module docstring)."""
    zv = zero_variance_rows(batch) if zero_var is None else zero_var
    abs_a = batch.advantages.detach().abs()
    # Lexicographic sort by successive stable sorts, least significant key first:
    # the row index (arange), then -|A|, then the zero-variance flag.
    order = torch.sort(-abs_a, stable=True).indices
    return order[torch.sort(zv[order].to(torch.int8), stable=True).indices]


def rank_in_group(batch: ScoredBatch, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows in ``order`` (a priority order), return ``(rows, rank)`` where ``rows`` is ``order``
    regrouped by group (stable, so priority is kept inside a group) and ``rank[i]`` is the position
    of ``rows[i]`` inside its group (0 = highest priority)."""
    gi = batch.group_index.long()
    rows = order[torch.sort(gi[order], stable=True).indices]
    g_sorted = gi[rows]
    counts = torch.bincount(g_sorted, minlength=int(gi.max()) + 1 if gi.numel() else 0)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(rows.numel(), device=rows.device) - starts[g_sorted]
    return rows, rank


def num_groups_present(batch: ScoredBatch) -> int:
    return int(torch.unique(batch.group_index).numel()) if batch.size else 0


def extra_prompts(kept: int, target_size: int | None, num_prompts: int, nominal_per_prompt: float) -> int:
    """More prompts to fill ``target_size - kept``: ``ceil(deficit / yield)``, ``yield`` the kept rows
    per prompt of this batch (``nominal_per_prompt`` when none was kept); at least 1 while short."""
    if target_size is None or kept >= target_size:
        return 0
    deficit = target_size - kept
    per_prompt = kept / num_prompts if kept > 0 and num_prompts > 0 else nominal_per_prompt
    if per_prompt <= 0:
        return deficit  # nothing to go on: assume one kept row per prompt
    return max(1, math.ceil(deficit / per_prompt - _FLOOR_EPS))


def kept_mask_to_rows(mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool -> ascending int64 row indices (what ``FilterResult.kept`` wants)."""
    return mask.nonzero().flatten().to(torch.long)


def kept_result(
    keep: torch.Tensor, target_size: int | None, num_prompts: int, nominal_per_prompt: float, **info: float
) -> FilterResult:
    """The result keeping the rows flagged in ``keep: [N]`` (N > 0), asking for the prompts that would
    fill ``target_size`` (:func:`extra_prompts`), with the info every filter writes and ``info``."""
    kept = kept_mask_to_rows(keep)
    n, k = int(keep.numel()), int(kept.numel())
    extra = extra_prompts(k, target_size, num_prompts, nominal_per_prompt)
    return FilterResult(kept, extra, {KEPT_FRACTION: k / n, NUM_KEPT: float(k), "num_rows": float(n), **info})
