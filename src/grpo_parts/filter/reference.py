"""Reference filter: keep every completion (the standard GRPO path)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .protocol import KEPT_FRACTION, FilterResult, ScoredBatch

__all__ = ["KeepAll"]


class KeepAll:
    name: ClassVar[str] = "keep_all"

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]:
        return []

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        kept = torch.arange(batch.size, dtype=torch.long, device=batch.rewards.device)
        return FilterResult(kept, 0, {KEPT_FRACTION: 1.0 if batch.size else 0.0})
