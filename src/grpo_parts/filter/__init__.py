"""Completion filters. Select by name with :func:`get_filter_class`."""

from __future__ import annotations

from typing import Any

from ..registry import load
from .protocol import CompletionFilter, FilterResult, ScoredBatch

IMPLEMENTATIONS: dict[str, str] = {
    "keep_all": "grpo_parts.filter.reference:KeepAll",
    "cppo": "grpo_parts.filter.cppo:TopKAbsAdvantage",
    "zero_variance": "grpo_parts.filter.group:ZeroVarianceGroups",
    "pods": "grpo_parts.filter.pods:MaxVarianceDownsample",
}
AUTO_PRIORITY: tuple[str, ...] = ("keep_all",)


def get_filter_class(name: str) -> Any:
    return load(IMPLEMENTATIONS, name, "filter")


__all__ = [
    "AUTO_PRIORITY",
    "IMPLEMENTATIONS",
    "CompletionFilter",
    "FilterResult",
    "ScoredBatch",
    "get_filter_class",
]
