"""Draft models for speculative sampling. Select by name with :func:`get_draft_class`."""

from __future__ import annotations

from collections.abc import Callable

from ..registry import PartClass, class_getter
from .protocol import DraftContext, DraftModel, DraftProposal, DraftTrainingBatch, TreeBudget, TreeDraftModel

IMPLEMENTATIONS: dict[str, str] = {
    "frozen_lm": "grpo_parts.draft.reference:FrozenLMDraft",
    "small_lm": "grpo_parts.draft.small_lm:CachedLMDraft",
    "ngram": "grpo_parts.draft.ngram:NGramDraft",
    "eagle": "grpo_parts.draft.eagle:EagleDraft",
}
AUTO_PRIORITY: tuple[str, ...] = ("ngram", "eagle", "small_lm", "frozen_lm")


#: the class registered as a name (imported on first use); build it with :mod:`grpo_parts.build`
get_draft_class: Callable[[str], PartClass[DraftModel]] = class_getter(IMPLEMENTATIONS, "draft")


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
