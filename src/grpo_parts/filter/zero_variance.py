"""DAPO dynamic sampling: drop every group whose rewards are all equal (arXiv 2503.14476).

Such a group has advantage 0 on every row: no policy gradient, only cost. DAPO drops it and samples
more prompts until the batch is full; here the drop is :class:`ZeroVarianceGroups` and the refill
:mod:`grpo_parts.filter.refill`. "All equal" is exact comparison of the rewards (a single completion
counts), as verl's ``algorithm.filter_groups`` and OpenRLHF's dynamic filtering at 0 / 1 accuracy.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from ._common import kept_result, nothing_kept, num_groups_present, zero_variance_rows
from .protocol import FilterResult, ScoredBatch


class ZeroVarianceGroups(BaseModel):
    """Keep every row of the groups whose rewards are not all equal."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: ClassVar[str] = "zero_variance"

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]:
        return []

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        n = batch.size
        if n == 0:
            return nothing_kept()
        zv = zero_variance_rows(batch)
        n_prompts = num_groups_present(batch)
        kept_groups = int(torch.unique(batch.group_index[~zv]).numel())
        info = {"num_groups": float(n_prompts), "dropped_groups": float(n_prompts - kept_groups)}
        # Nominal yield when every group was dropped: a whole group per prompt (optimistic; the
        # refill loop keeps asking until the target is met or its round limit is reached).
        return kept_result(~zv, target_size, n_prompts, n / n_prompts, **info)
