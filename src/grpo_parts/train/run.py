"""Moved to :mod:`grpo_parts.train.lifecycle.run` (``train/`` is split by concern); the names examples and
users import from here are re-exported."""

from __future__ import annotations

from .lifecycle.run import RunResult, resume_config, train

__all__ = ["RunResult", "resume_config", "train"]
