"""Moved to :mod:`grpo_parts.train.step.loop` (``train/`` is split by concern); the names examples and
users import from here are re-exported."""

from __future__ import annotations

from .step.loop import GRPOTrainer, ProblemStream

__all__ = ["GRPOTrainer", "ProblemStream"]
