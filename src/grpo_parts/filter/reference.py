"""Reference filter: keep every completion (the standard GRPO path); reference prompt skipper:
roll out every prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from .protocol import KEPT_FRACTION, FilterResult, ScoredBatch
from .skip_protocol import PromptId, SkipDecision


class KeepAll:
    name: ClassVar[str] = "keep_all"

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]:
        return []

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        kept = torch.arange(batch.size, dtype=torch.long, device=batch.rewards.device)
        return FilterResult(
            kept=kept, extra_prompts_wanted=0, info={KEPT_FRACTION: 1.0 if batch.size else 0.0}
        )


class KeepEveryPrompt:
    """Reference prompt skipper (``none``): every drawn prompt is rolled out, weight 1."""

    name: ClassVar[str] = "none"
    min_keep_prob: float = 1.0

    def inclusion_probability(self, prompt_id: PromptId) -> float:
        return 1.0

    def decide(
        self,
        prompt_ids: Sequence[PromptId],
        generator: torch.Generator | None = None,
        target: float | None = None,
    ) -> SkipDecision:
        """Keep them all (``target`` is not used: a stream drawing through this keeps what it draws)."""
        n = len(prompt_ids)
        return SkipDecision(torch.arange(n), None, torch.ones(n, dtype=torch.float64))

    def observe(
        self,
        prompt_ids: Sequence[PromptId],
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
