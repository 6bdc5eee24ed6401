"""Decoding primitives shared by the samplers and the drafts, so neither imports the other's internals."""

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
