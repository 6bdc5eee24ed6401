"""Moved to :mod:`grpo_parts.skip.protocol` (prompt skipping is a Protocol package of its own); the
names earlier 0.1 commits exported here are re-exported."""

from __future__ import annotations

from ..skip.protocol import (
    DrawsPrompts,
    PeeksPrompts,
    PromptId,
    PromptSkipper,
    ReportsHistory,
    SkipDecision,
    prompt_key,
    prompt_skip_reasons,
    skips,
)

__all__ = [
    "DrawsPrompts",
    "PeeksPrompts",
    "PromptId",
    "PromptSkipper",
    "ReportsHistory",
    "SkipDecision",
    "prompt_key",
    "prompt_skip_reasons",
    "skips",
]
