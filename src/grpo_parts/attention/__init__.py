"""Attention backends. Select by name with :func:`get_attention_class`."""

from __future__ import annotations

from collections.abc import Callable

from ..registry import PartClass, class_getter
from .protocol import AttentionBackend, LogprobBatch, LogprobOutput

IMPLEMENTATIONS: dict[str, str] = {
    "reference": "grpo_parts.attention.reference:RepeatedPrefixAttention",
    "shared_prefix": "grpo_parts.attention.shared_prefix:SharedPrefixAttention",
}
AUTO_PRIORITY: tuple[str, ...] = ("shared_prefix", "reference")


#: the class registered as a name (imported on first use); build it with :mod:`grpo_parts.build`
get_attention_class: Callable[[str], PartClass[AttentionBackend]] = class_getter(IMPLEMENTATIONS, "attention")


__all__ = [
    "AUTO_PRIORITY",
    "IMPLEMENTATIONS",
    "AttentionBackend",
    "LogprobBatch",
    "LogprobOutput",
    "get_attention_class",
]
