"""The speculative sampler (FastGRPO): drafts sized by concurrency, verified losslessly
(docs/speculative.md)."""

from __future__ import annotations

from .config import SpeculativeConfig
from .sampler import SpeculativeSampler

__all__ = ["SpeculativeConfig", "SpeculativeSampler"]
