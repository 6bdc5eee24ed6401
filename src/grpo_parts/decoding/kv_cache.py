"""KV-cache row operations on right-aligned rows with masked *holes*; the cache-class differences
across transformers releases stay in :mod:`grpo_parts.compat`."""

from __future__ import annotations

from typing import Any

import torch

from ..compat import cache_layers


def right_align(buf: torch.Tensor, ends: torch.Tensor, width: int, fill: int | float) -> torch.Tensor:
    """Row ``a`` of ``buf: [A, W, ...]`` has its real entries ending (exclusive) at ``ends[a]``;
    return ``[A, width, ...]`` with those entries shifted to end at ``width``."""
    shift = width - ends  # [A]
    src = torch.arange(width, device=buf.device)[None, :] - shift[:, None]
    valid = src >= 0
    src = src.clamp(min=0, max=buf.shape[1] - 1)
    idx = src.view(*src.shape, *([1] * (buf.ndim - 2))).expand(-1, -1, *buf.shape[2:])
    out = buf.gather(1, idx)
    return out.masked_fill(~valid.view(*valid.shape, *([1] * (buf.ndim - 2))), fill)


def compact_cache(cache: Any, mask: torch.Tensor, start: int = 0) -> torch.Tensor | None:
    """Gather each row's live KV entries (``mask == 1``) among columns ``>= start`` to the right end
    of the cache, in order; columns ``< start`` stay where they are (the speculative sampler keeps
    the prompt's columns in place so its decode attention can read them once per group). Returns
    the new mask, or None when the cache type has no ``layers[i].keys/values``."""
    layers = cache_layers(cache)
    if layers is None:
        return None
    tail = mask[:, start:]
    width = int(tail.sum(-1).max())
    # holes first, then live in order
    idx = start + torch.sort(tail, dim=-1, stable=True).indices[:, tail.shape[1] - width :]
    for ly in layers:
        if not getattr(ly, "is_initialized", True) or ly.keys.numel() == 0:
            continue
        g = idx[:, None, :, None].expand(-1, ly.keys.shape[1], -1, ly.keys.shape[-1])
        keys, values = ly.keys.gather(2, g), ly.values.gather(2, g)
        if start > 0:
            keys = torch.cat([ly.keys[:, :, :start], keys], 2)
            values = torch.cat([ly.values[:, :, :start], values], 2)
        ly.keys, ly.values = keys, values
        if hasattr(ly, "cumulative_length"):  # sliding-window layers size their masks from it
            ly.cumulative_length = ly.keys.shape[-2]
    return torch.cat([mask[:, :start], mask.gather(1, idx)], 1)


def compact_block(cache: Any, order: torch.Tensor, keep: int | None = None) -> bool:
    """Reorder the last ``B`` cache columns of every row by ``order: [A, B]`` (column indices into the block),
    in place: used to move a verified tree's accepted path to the front of its block so the rest can be
    cropped. With ``keep``, only the block's first ``keep`` columns are written (the rest are about to be
    cropped or masked). False when the cache type has no ``layers[i].keys/values``."""
    layers = cache_layers(cache)
    if layers is None:
        return False
    b = order.shape[1]
    m = b if keep is None else min(max(keep, 0), b)
    if m == 0:
        return True
    order = order[:, :m]
    for ly in layers:
        if not getattr(ly, "is_initialized", True) or ly.keys.numel() == 0:
            continue
        g = order[:, None, :, None].expand(-1, ly.keys.shape[1], -1, ly.keys.shape[-1])
        end = ly.keys.shape[2] - b + m
        ly.keys[:, :, -b:end] = ly.keys[:, :, -b:].gather(2, g)
        ly.values[:, :, -b:end] = ly.values[:, :, -b:].gather(2, g)
    return True
