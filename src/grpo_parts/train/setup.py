"""Moved to :mod:`grpo_parts.train.lifecycle.setup` (``train/`` is split by concern); the names examples and
users import from here are re-exported."""

from __future__ import annotations

from .lifecycle.setup import builtin_model_path, eos_ids, load_model

__all__ = ["builtin_model_path", "eos_ids", "load_model"]
