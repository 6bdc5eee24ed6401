"""Moved to :mod:`grpo_parts.skip.draw` (prompt skipping is a Protocol package of its own); the
names earlier 0.1 commits exported here are re-exported."""

from __future__ import annotations

from ..skip.draw import PromptDraw, SkipRound, lattice_sample, probabilities_for_target

__all__ = ["PromptDraw", "SkipRound", "lattice_sample", "probabilities_for_target"]
