"""Attention backends. Select by name with :func:`get_attention_class`."""

from __future__ import annotations

from ..registry import PartClass, load_class
from .protocol import AttentionBackend, LogprobBatch, LogprobOutput

IMPLEMENTATIONS: dict[str, str] = {
    "reference": "grpo_parts.attention.reference:RepeatedPrefixAttention",
    "shared_prefix": "grpo_parts.attention.shared_prefix:SharedPrefixAttention",
}
AUTO_PRIORITY: tuple[str, ...] = ("shared_prefix", "reference")


def get_attention_class(name: str) -> PartClass[AttentionBackend]:
    """The class registered as ``name`` (imported on first use); build it with :mod:`grpo_parts.build`."""
    return load_class(IMPLEMENTATIONS, name, "attention")


__all__ = [
    "AUTO_PRIORITY",
    "IMPLEMENTATIONS",
    "AttentionBackend",
    "LogprobBatch",
    "LogprobOutput",
    "get_attention_class",
]
