"""The speculative sampler (FastGRPO): drafts sized by concurrency, verified losslessly.

One module per step of a speculative rollout; docs/speculative.md describes each, in order.
"""

from __future__ import annotations

from .config import SpeculativeConfig
from .sampler import SpeculativeSampler

__all__ = ["SpeculativeConfig", "SpeculativeSampler"]
