"""CPPO completion pruning: keep the completions with the largest ``|advantage|`` (arXiv 2503.22342).

A completion's share of the policy gradient scales with ``|A|``, so training on the top-k rows keeps
most of the signal at a fraction of the forward-backward cost. ``scope="global"`` (CPPO's own code):
one top-k over the batch; ``"group"``: ``k`` per group. The tie rule is deterministic, unlike the
paper's code; zero-advantage rows are never kept under ``drop_zero_advantage`` (docs/filter.md,
"Global vs group scope" and "Tie rule and zero-variance groups").
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._common import (
    check_count_or_rate,
    kept_result,
    nothing_kept,
    num_groups_present,
    num_kept,
    priority_order,
    rank_in_group,
    zero_variance_rows,
)
from .protocol import FilterResult, ScoredBatch


class TopKAbsAdvantage(BaseModel):
    """Keep the top-k rows by ``|advantage|``. Give exactly one of ``k`` or ``pruning_rate``.
    ``min_per_group``: every group with non-zero advantages keeps at least this many rows (as many as it
    has, if fewer); the minimum wins over ``k``, so the kept count can exceed ``k``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: ClassVar[str] = "cppo"

    k: int | None = Field(None, ge=1, description="rows kept (global) or rows kept per group (group)")
    pruning_rate: float | None = Field(None, ge=0.0, lt=1.0, description="fraction P of rows pruned")
    scope: Literal["global", "group"] = "global"
    min_per_group: int = Field(0, ge=0)
    drop_zero_advantage: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TopKAbsAdvantage:
        check_count_or_rate("k", self.k, self.pruning_rate)
        if self.scope == "group" and self.k is not None and self.min_per_group > self.k:
            raise ValueError(
                f"min_per_group: expected <= k={self.k} with scope='group', got {self.min_per_group}"
            )
        return self

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]:
        return []

    def _nominal_per_prompt(self, n_rows: int, n_prompts: int) -> float:
        """Kept rows per prompt this filter aims for (used for refill when nothing was kept)."""
        if self.k is not None:
            return float(self.k) if self.scope == "group" else self.k / n_prompts
        return (1.0 - float(self.pruning_rate or 0.0)) * n_rows / n_prompts

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        n = batch.size
        n_prompts = num_groups_present(batch)
        if n == 0:
            return nothing_kept()
        zv = zero_variance_rows(batch)
        eligible = ~zv & (batch.advantages != 0) if self.drop_zero_advantage else torch.ones_like(zv)
        order = priority_order(batch, zv)
        rows, rank = rank_in_group(batch, order)
        # Ineligible rows of a group sort after its eligible ones (|A| = 0 is the smallest), so
        # ``rank`` is also the rank among the group's eligible rows.
        keep = torch.zeros(n, dtype=torch.bool, device=zv.device)
        if self.scope == "group":
            gi = batch.group_index.long()
            sizes = torch.bincount(gi)
            if self.k is not None:
                quota = torch.full_like(sizes, self.k)
            else:
                p = float(self.pruning_rate or 0.0)
                quota = torch.tensor([num_kept(int(s), p) for s in sizes.tolist()], dtype=torch.long)
            quota = quota.clamp(min=self.min_per_group).to(rows.device)
            sel = rows[rank < quota[gi[rows]]]
            keep[sel] = True
        else:
            total = self.k if self.k is not None else num_kept(n, float(self.pruning_rate or 0.0))
            forced = rows[rank < self.min_per_group]
            keep[forced] = True
            keep &= eligible
            budget = total - int(keep.sum())
            if budget > 0:
                rest = order[(eligible & ~keep)[order]]
                keep[rest[:budget]] = True
        keep &= eligible
        nominal = self._nominal_per_prompt(n, n_prompts)
        info = {"zero_variance_rows": float(zv.sum()), "num_groups": float(n_prompts)}
        return kept_result(keep, target_size, n_prompts, nominal, **info)
