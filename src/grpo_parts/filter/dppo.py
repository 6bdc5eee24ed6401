"""Unbiased completion pruning (the idea of DPPO, arXiv 2603.04135): keep row ``i`` at random with
probability ``p_i = clamp(|A_i| * t, min_keep_prob, 1)`` (``t``: so that ``sum p`` is the target kept
count) and weight it ``1 / p_i``, so the expected loss and gradient are the full batch's -- unlike
CPPO (:mod:`.cppo`), whose top-k drop changes the expected gradient.

Rows whose advantage is exactly 0 get ``p = 0`` under ``drop_zero_advantage``: exact only when every
loss term vanishes at ``A = 0`` (:meth:`DPPOFilter.loss_not_supported_reasons` refuses a KL or
entropy term). The loss must take the weights and the *whole* batch's denominators
(:func:`grpo_parts.filter.apply.apply_filter` returns both). Rule, sampling designs, floor and
proof: docs/filter.md, "Unbiased pruning (``dppo``)".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ..core import LossConfig
from ..core.inclusion import inclusion_probabilities, systematic_sample
from ..core.unbiased import loss_facts, refusal_reasons
from ._common import kept_mask_to_rows, nothing_kept, num_kept
from .protocol import KEPT_FRACTION, NUM_KEPT, FilterResult, ScoredBatch

__all__ = ["DPPOFilter"]

_EPS = 1e-9
#: the pruning rate when neither ``k`` nor ``pruning_rate`` is given
_DEFAULT_RATE = 0.5


class DPPOFilter(BaseModel):
    """The module docstring's rule with expected kept count ``k`` (or ``N - floor(P * N)``); give at most
    one of ``k`` or ``pruning_rate`` (neither: ``pruning_rate = 0.5``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: ClassVar[str] = "dppo"

    k: int | None = Field(None, ge=1, description="expected rows kept")
    pruning_rate: float | None = Field(None, ge=0.0, lt=1.0, description="fraction P of rows pruned")
    min_keep_prob: float = Field(0.1, gt=0.0, le=1.0, description="floor on a row's keep probability")
    drop_zero_advantage: bool = True
    sampling: Literal["systematic", "bernoulli"] = "systematic"
    seed: int = Field(0, ge=0)
    _generator: torch.Generator = PrivateAttr()

    @model_validator(mode="after")
    def _one_of(self) -> DPPOFilter:
        if self.k is not None and self.pruning_rate is not None:
            raise ValueError(
                f"k / pruning_rate: expected at most one of them, got k={self.k}, pruning_rate={self.pruning_rate}"
            )
        return self

    def model_post_init(self, context: Any, /) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._generator.set_state(state["generator"])

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]:
        if batch.size and not bool(torch.isfinite(batch.advantages).all()):
            return ["advantages: expected finite values (dppo's keep probabilities scale with |A|), got inf"]
        return []

    def loss_not_supported_reasons(self, config: LossConfig) -> list[str]:
        """Why the weighted loss under ``config`` would not be unbiased (empty list = it is): the rule
        of :mod:`grpo_parts.core.unbiased` on ``config``'s facts and this filter's."""
        facts = loss_facts(config, "dppo")
        if self.drop_zero_advantage and (config.kl_coef > 0 or config.entropy_coef > 0):
            term = "kl_coef > 0" if config.kl_coef > 0 else "entropy_coef > 0"
            fix = "set drop_zero_advantage=False (rows with A = 0 still carry the KL/entropy gradient)"
            facts = replace(facts, unkept=((f"drop_zero_advantage=True with {term}", fix),))
        return [f"dppo: {r}" for r in refusal_reasons(facts)]

    def target_kept(self, num_rows: int) -> int:
        """The kept count aimed for before the floor: ``k``, or ``N - floor(P * N)``."""
        if self.k is not None:
            return self.k
        return num_kept(num_rows, _DEFAULT_RATE if self.pruning_rate is None else self.pruning_rate)

    def inclusion_probs(self, batch: ScoredBatch) -> torch.Tensor:
        """``[N]`` float64 (CPU): each row's probability of being kept by :meth:`select` (no randomness)."""
        a = batch.advantages.detach().abs().to(torch.float64).cpu()
        eligible = a > 0 if self.drop_zero_advantage else torch.ones_like(a, dtype=torch.bool)
        p = torch.zeros_like(a)
        n_e = int(eligible.sum())
        if n_e == 0:
            return p
        target = min(n_e, max(self.target_kept(batch.size), math.ceil(self.min_keep_prob * n_e - _EPS)))
        p[eligible] = inclusion_probabilities(a[eligible], float(target), self.min_keep_prob)
        return p

    def _draw(self, p: torch.Tensor) -> torch.Tensor:
        if self.sampling == "systematic":
            return systematic_sample(p, self._generator)
        return torch.rand(p.shape, generator=self._generator, dtype=torch.float64) < p

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        """Draw the kept rows; ``weights = 1 / p`` of each. ``extra_prompts_wanted`` is always 0:
        refill trims by priority and its round count depends on the draw, which would bias the
        estimate; size the batch up front instead (``N = target / (1 - P)``)."""
        n = batch.size
        device = batch.advantages.device
        if n == 0:
            return nothing_kept(weighted=True)
        p = self.inclusion_probs(batch)
        kept = kept_mask_to_rows(self._draw(p))
        weights = 1.0 / p[kept]
        positive = p[p > 0]
        info = {
            KEPT_FRACTION: kept.numel() / n,
            NUM_KEPT: float(kept.numel()),
            "num_rows": float(n),
            "eligible_rows": float(positive.numel()),
            "expected_kept": float(p.sum()),
            "min_keep_prob": float(positive.min()) if positive.numel() else 0.0,
            "max_weight": float(weights.max()) if kept.numel() else 0.0,
        }
        return FilterResult(kept.to(device), 0, info, weights.to(device))
