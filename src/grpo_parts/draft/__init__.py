"""Draft models for speculative sampling. Select by name with :func:`get_draft_class`."""

from __future__ import annotations

from ..registry import PartClass, load_class
from .protocol import DraftContext, DraftModel, DraftProposal, DraftTrainingBatch, TreeBudget, TreeDraftModel

IMPLEMENTATIONS: dict[str, str] = {
    "frozen_lm": "grpo_parts.draft.reference:FrozenLMDraft",
    "small_lm": "grpo_parts.draft.small_lm:CachedLMDraft",
    "ngram": "grpo_parts.draft.ngram:NGramDraft",
    "eagle": "grpo_parts.draft.eagle:EagleDraft",
}
AUTO_PRIORITY: tuple[str, ...] = ("ngram", "eagle", "small_lm", "frozen_lm")


def get_draft_class(name: str) -> PartClass[DraftModel]:
    """The class registered as ``name`` (imported on first use); build it with :mod:`grpo_parts.build`."""
    return load_class(IMPLEMENTATIONS, name, "draft")


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
