"""Moved to :mod:`grpo_parts.train.step.parts` (``train/`` is split by concern); the names examples and
users import from here are re-exported."""

from __future__ import annotations

from .step.parts import Parts

__all__ = ["Parts"]
