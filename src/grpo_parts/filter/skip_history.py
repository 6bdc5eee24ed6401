"""Moved to :mod:`grpo_parts.skip.history` (prompt skipping is a Protocol package of its own); the
names earlier 0.1 commits exported here are re-exported."""

from __future__ import annotations

from ..skip.history import HistorySkipper, PromptRecord

__all__ = ["HistorySkipper", "PromptRecord"]
