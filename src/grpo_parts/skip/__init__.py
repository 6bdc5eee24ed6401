"""Prompt skippers: skip prompts *before* rollout, unbiasedly (the ``PromptSkipper`` Protocol):
:mod:`.protocol` (the Protocol and the unbiasedness check), :mod:`.reference` (``none``),
:mod:`.history` (``history``: GRESO's rule with ``1 / p`` weights) and :mod:`.draw` (the stream that
draws a round past a skipper). Select with :func:`get_skipper_class`; build with
:func:`grpo_parts.build.build_prompt_skipper`.
"""

from __future__ import annotations

from ..registry import PartClass, load_class
from .protocol import PromptSkipper

#: prompt skippers by name (``parts.prompt_skip``) -> "module:Class", imported lazily
IMPLEMENTATIONS: dict[str, str] = {
    "none": "grpo_parts.skip.reference:KeepEveryPrompt",
    "history": "grpo_parts.skip.history:HistorySkipper",
}


def get_skipper_class(name: str) -> PartClass[PromptSkipper]:
    """The prompt skipper registered as ``name`` in :data:`IMPLEMENTATIONS` (imported on first use)."""
    return load_class(IMPLEMENTATIONS, name, "prompt_skip")


__all__ = ["IMPLEMENTATIONS", "PromptSkipper", "get_skipper_class"]
