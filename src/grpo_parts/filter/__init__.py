"""Completion filters. Select by name with :func:`get_filter_class`; prompt skippers (before
rollout) with :func:`get_skipper_class`."""

from __future__ import annotations

from ..registry import PartClass, load_class
from .protocol import CompletionFilter, FilterResult, ScoredBatch
from .skip_protocol import PromptSkipper

IMPLEMENTATIONS: dict[str, str] = {
    "keep_all": "grpo_parts.filter.reference:KeepAll",
    "cppo": "grpo_parts.filter.cppo:TopKAbsAdvantage",
    "zero_variance": "grpo_parts.filter.group:ZeroVarianceGroups",
    "pods": "grpo_parts.filter.pods:MaxVarianceDownsample",
    "dppo": "grpo_parts.filter.dppo:DPPOFilter",
}
AUTO_PRIORITY: tuple[str, ...] = ("keep_all",)
#: prompt skippers (:class:`~.skip_protocol.PromptSkipper`), the trainer's ``parts.prompt_skip``
SKIPPERS: dict[str, str] = {
    "none": "grpo_parts.filter.reference:KeepEveryPrompt",
    "history": "grpo_parts.filter.skip_history:HistorySkipper",
}


def get_filter_class(name: str) -> PartClass[CompletionFilter]:
    """The class registered as ``name`` (imported on first use); build it with :mod:`grpo_parts.build`."""
    return load_class(IMPLEMENTATIONS, name, "filter")


def get_skipper_class(name: str) -> PartClass[PromptSkipper]:
    """The prompt skipper registered as ``name`` in :data:`SKIPPERS` (imported on first use)."""
    return load_class(SKIPPERS, name, "prompt_skip")


__all__ = [
    "AUTO_PRIORITY",
    "IMPLEMENTATIONS",
    "SKIPPERS",
    "CompletionFilter",
    "FilterResult",
    "PromptSkipper",
    "ScoredBatch",
    "get_filter_class",
    "get_skipper_class",
]
