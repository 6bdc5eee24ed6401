"""The speculative sampler (FastGRPO): drafts sized by concurrency, verified losslessly.

One module per step of a speculative rollout, in the order a decode step meets them:

* :mod:`.sampler` -- :class:`SpeculativeSampler`, the ``Sampler`` itself (set-up, refusals, stats);
* :mod:`.config` -- :class:`SpeculativeConfig`;
* :mod:`.decode_loop` -- the per-row decode state: KV cache with holes, emitted tokens, finishing rows;
* :mod:`.cost_model`, :mod:`.tree_cost`, :mod:`.acceptance` -- how many tokens to draft (chain or
  tree) for the rows still generating, from measured step times and the online acceptance rate;
* :mod:`.calibration` -- the start-up timing that seeds the cost model;
* :mod:`.verify`, :mod:`.tree_verify` -- exact (lossless) verification of a chain or a tree;
* :mod:`.decode_attention` -- decode attention that reads a group's shared prompt once;
* :mod:`.lean_forward` -- the policy's decode forward without transformers' per-call overhead;
* :mod:`.model_support` -- which policies can be served (sliding windows, recurrent layers);
* :mod:`.trace` -- the per-step decode trace behind report.md's draft-size table.
"""

from __future__ import annotations

from .config import SpeculativeConfig
from .sampler import SpeculativeSampler

__all__ = ["SpeculativeConfig", "SpeculativeSampler"]
