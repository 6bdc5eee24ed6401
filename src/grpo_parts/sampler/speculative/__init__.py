"""The speculative sampler (FastGRPO): drafts sized by concurrency, verified losslessly.

:mod:`.sampler` (the ``Sampler``) and :mod:`.config`; :mod:`.decode_loop` (the cache with holes);
:mod:`.cost_model`, :mod:`.tree_cost`, :mod:`.acceptance`, :mod:`.calibration` (how much to draft);
:mod:`.verify`, :mod:`.tree_verify` (lossless verification); :mod:`.decode_attention`,
:mod:`.lean_forward`, :mod:`.forward_chain`, :mod:`.refusals` (fast decode forwards);
:mod:`.model_support` (which policies), :mod:`.trace` (per-step trace). docs/speculative.md.
"""

from __future__ import annotations

from .config import SpeculativeConfig
from .sampler import SpeculativeSampler

__all__ = ["SpeculativeConfig", "SpeculativeSampler"]
