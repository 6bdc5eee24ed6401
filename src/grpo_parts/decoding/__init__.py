"""Decoding primitives shared by the samplers (``grpo_parts.sampler``) and the drafts
(``grpo_parts.draft``), so that neither package imports the other's internals. One module each:

* :mod:`.sampling` -- :class:`SamplingParams` (re-exported by ``grpo_parts.sampler``) and the logit
  processing every sampler and draft applies (:func:`sampling_probs`, :func:`sample_tokens`, :func:`draw`);
* :mod:`.collector` -- :func:`collector_paused`: automatic garbage collection off for one decode loop;
* :mod:`.kv_cache` -- KV-cache row operations on right-aligned rows with masked holes;
* :mod:`.kv_room` -- cache buffers that append in place (geometric room) instead of copying;
* :mod:`.tree_mask` -- draft-tree ancestor sets and attention masks;
* :mod:`.lean_layer` -- a Llama-family decoder layer as plain tensor ops (the speculative sampler's
  lean decode forward and the EAGLE head's drafting path).
"""

from __future__ import annotations

from .collector import collector_paused
from .kv_cache import compact_block, compact_cache, right_align
from .kv_room import CACHE_ROOM, drop_cache_rows, reserve_cache_room
from .sampling import SamplingParams, draw, sample_tokens, sampling_logits, sampling_probs
from .tree_mask import additive_mask, tree_allowed, tree_ancestors, tree_attention_mask

__all__ = [
    "CACHE_ROOM",
    "SamplingParams",
    "additive_mask",
    "collector_paused",
    "compact_block",
    "compact_cache",
    "draw",
    "drop_cache_rows",
    "reserve_cache_room",
    "right_align",
    "sample_tokens",
    "sampling_logits",
    "sampling_probs",
    "tree_allowed",
    "tree_ancestors",
    "tree_attention_mask",
]
