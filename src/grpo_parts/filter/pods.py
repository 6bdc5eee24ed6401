"""PODS max-variance down-sampling: keep the ``m`` completions of each group whose rewards have the
largest variance (arXiv 2504.13818).

A maximal-variance subset is always made of extremes, the ``i`` lowest and ``m - i`` highest rewards
(PODS, Lemma 1), so a group costs ``O(G log G + m^2)``. Tie rule: rows ordered by ``(reward, row)``;
among candidates of equal variance the smallest ``i`` wins. Zero-variance groups are dropped under
``drop_zero_variance``. The kept rows keep the advantages computed over the whole group.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._common import (
    check_count_or_rate,
    kept_result,
    nothing_kept,
    num_groups_present,
    num_kept,
    zero_variance_rows,
)
from .protocol import FilterResult, ScoredBatch


def max_variance_subset(rewards: torch.Tensor, m: int) -> torch.Tensor:
    """Positions (into ``rewards: [G]``) of the size-``min(m, G)`` subset with the largest population
    variance, ascending; tie rule in the module docstring."""
    g = int(rewards.numel())
    if m >= g:
        return torch.arange(g, dtype=torch.long)
    r = rewards.detach().to(torch.float64)
    order = torch.sort(r, stable=True).indices  # (reward, position) ascending
    best_i, best_var = 0, -1.0
    for i in range(m + 1):
        pick = torch.cat([order[:i], order[g - (m - i) :]])
        var = float(r[pick].var(unbiased=False)) if m > 1 else 0.0
        if var > best_var:
            best_i, best_var = i, var
    pick = torch.cat([order[:best_i], order[g - (m - best_i) :]])
    return torch.sort(pick).values


class MaxVarianceDownsample(BaseModel):
    """Keep ``m`` rows per group (or ``G_g - floor(P * G_g)`` with a pruning rate) maximising the
    group's reward variance. Give exactly one of ``m`` or ``pruning_rate``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: ClassVar[str] = "pods"

    m: int | None = Field(None, ge=1, description="rows kept per group")
    pruning_rate: float | None = Field(None, ge=0.0, lt=1.0)
    drop_zero_variance: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> MaxVarianceDownsample:
        check_count_or_rate("m", self.m, self.pruning_rate)
        return self

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]:
        return []

    def _m_for(self, group_size: int) -> int:
        return self.m if self.m is not None else num_kept(group_size, float(self.pruning_rate or 0.0))

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        n = batch.size
        if n == 0:
            return nothing_kept()
        zv = zero_variance_rows(batch)
        keep = torch.zeros(n, dtype=torch.bool)
        gi = batch.group_index.long().cpu()
        rewards = batch.rewards.detach().cpu()
        for g in torch.unique(gi).tolist():
            rows = (gi == g).nonzero().flatten()  # ascending row index
            if self.drop_zero_variance and bool(zv[rows[0]]):
                continue
            keep[rows[max_variance_subset(rewards[rows], self._m_for(rows.numel()))]] = True
        n_prompts = num_groups_present(batch)
        nominal = float(self._m_for(round(n / n_prompts)))
        return kept_result(keep.to(batch.rewards.device), target_size, n_prompts, nominal)
