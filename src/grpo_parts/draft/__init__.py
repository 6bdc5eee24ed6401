"""Draft models for speculative sampling. Select by name with :func:`get_draft_class`."""

from __future__ import annotations

from typing import Any

from ..registry import load
from .protocol import DraftContext, DraftModel, DraftProposal, DraftTrainingBatch, TreeBudget, TreeDraftModel

IMPLEMENTATIONS: dict[str, str] = {
    "frozen_lm": "grpo_parts.draft.reference:FrozenLMDraft",
    "small_lm": "grpo_parts.draft.small_lm:CachedLMDraft",
    "ngram": "grpo_parts.draft.ngram:NGramDraft",
    "eagle": "grpo_parts.draft.eagle:EagleDraft",
}
AUTO_PRIORITY: tuple[str, ...] = ("ngram", "eagle", "small_lm", "frozen_lm")


def get_draft_class(name: str) -> Any:
    return load(IMPLEMENTATIONS, name, "draft")


__all__ = [
    "AUTO_PRIORITY",
    "IMPLEMENTATIONS",
    "DraftContext",
    "DraftModel",
    "DraftProposal",
    "DraftTrainingBatch",
    "TreeBudget",
    "TreeDraftModel",
    "get_draft_class",
]
