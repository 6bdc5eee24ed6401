"""Completion filters (after rollout, before the update). Select by name with
:func:`get_filter_class`. Prompt skippers (before rollout) are :mod:`grpo_parts.skip`."""

from __future__ import annotations

from ..registry import PartClass, load_class
from .protocol import CompletionFilter, FilterResult, ScoredBatch

IMPLEMENTATIONS: dict[str, str] = {
    "keep_all": "grpo_parts.filter.reference:KeepAll",
    "cppo": "grpo_parts.filter.cppo:TopKAbsAdvantage",
    "zero_variance": "grpo_parts.filter.zero_variance:ZeroVarianceGroups",
    "pods": "grpo_parts.filter.pods:MaxVarianceDownsample",
    "dppo": "grpo_parts.filter.dppo:DPPOFilter",
}


def get_filter_class(name: str) -> PartClass[CompletionFilter]:
    """The class registered as ``name`` (imported on first use); build it with :mod:`grpo_parts.build`."""
    return load_class(IMPLEMENTATIONS, name, "filter")


__all__ = ["IMPLEMENTATIONS", "CompletionFilter", "FilterResult", "ScoredBatch", "get_filter_class"]
