"""Reference prompt skipper: roll out every prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch

from .protocol import PromptId, SkipDecision

__all__ = ["KeepEveryPrompt"]


class KeepEveryPrompt:
    """Reference prompt skipper (``none``): every drawn prompt is rolled out, weight 1."""

    name: ClassVar[str] = "none"
    min_keep_prob: float = 1.0
    step_size: Literal["fill", "fewer"] = "fill"
    min_rollout_share: float = 0.0

    def inclusion_probability(self, prompt_id: PromptId) -> float:
        return 1.0

    def decide(self, prompt_ids: Sequence[PromptId], *_: Any, **__: Any) -> SkipDecision:
        """Keep them all (no draw, and no ``target``: a stream drawing through this keeps what it draws)."""
        n = len(prompt_ids)
        return SkipDecision(torch.arange(n), None, torch.ones(n, dtype=torch.float64))

    def observe(self, *_: Any, **__: Any) -> None:
        """Nothing to learn: every prompt is rolled out whatever its rewards."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
