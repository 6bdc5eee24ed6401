"""Draft-tree masks: which block and cache columns each tree node sees, as booleans or additive masks."""

from __future__ import annotations

import torch


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``parents: [A, N]`` (node ``i``'s parent node, ``-1`` = the root, always ``< i``) ->
    ``anc: [A, N + 1, N + 1]`` bool, ``anc[a, i, j]`` = column ``j`` is column ``i`` or one of its
    ancestors, where column 0 is the root (the row's last token) and column ``i + 1`` is node ``i``.

    Walks every column up to the root at once, one level per iteration (trees are shallow: the loop
    runs depth + 1 times, not N times)."""
    a, n = parents.shape
    dev = parents.device
    anc = torch.eye(n + 1, dtype=torch.bool, device=dev).expand(a, -1, -1).clone()
    root = torch.zeros(a, 1, dtype=torch.long, device=dev)
    up = torch.cat([root, parents + 1], 1)  # column -> parent column
    cur = up
    for _ in range(n):
        anc.scatter_(2, cur[..., None], True)
        if not bool(cur.any()):  # every column reached the root
            break
        cur = up.gather(1, cur)
    return anc


def tree_allowed(past: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """``[A, T, P + T]`` bool: what each query of a cached forward of a tree block sees -- the live past
    columns (``past: [A, P]``, 1 = live) and its own ancestors-or-self in the block (``anc: [A, T, T]``)."""
    a, t = anc.shape[:2]
    return torch.cat([past.bool()[:, None, :].expand(a, t, -1), anc], -1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed: [A, T, K]`` bool as an additive 4-D mask ``[A, 1, T, K]`` (0 / dtype min): eager
    adds it, SDPA takes it as is."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def tree_attention_mask(past: torch.Tensor, anc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[A, 1, T, P + T]`` of :func:`tree_allowed`."""
    return additive_mask(tree_allowed(past, anc), dtype)
