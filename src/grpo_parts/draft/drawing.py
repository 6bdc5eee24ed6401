"""What the model drafts share: drawing a chain token by token, a tree of the configured kind, and
the columns of the new tokens a cached draft feeds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..decoding import SamplingParams, sampling_probs
from .protocol import DraftProposal, TreeBudget
from .tree import Expand, topk_tree
from .tree_sampled import sampled_tree


def draw_chain(
    logits: torch.Tensor, step: Callable[[int, torch.Tensor], torch.Tensor], num_tokens: int,
    params: SamplingParams, generator: torch.Generator | None,
) -> DraftProposal:  # fmt: skip
    """``num_tokens`` tokens per row, each drawn (greedy: the argmax) from the processed
    distribution of ``logits: [A, V]``, then of ``step(i, drawn)`` -- the next logits once the
    ``i``-th tokens ``[A]`` are fed -- with the distributions they came from."""
    toks, probs = [], []
    for i in range(num_tokens):
        q = sampling_probs(logits, params)
        d = q.argmax(-1) if params.greedy else torch.multinomial(q, 1, generator=generator).squeeze(-1)
        toks.append(d)
        probs.append(q)
        if i < num_tokens - 1:
            logits = step(i, d)
    return DraftProposal(torch.stack(toks, 1), torch.stack(probs, 1))


def draw_tree(
    root: torch.Tensor, expand: Expand, budget: TreeBudget, params: SamplingParams,
    generator: torch.Generator | None, sampled: bool,
) -> DraftProposal:  # fmt: skip
    """Children sampled in a fixed shape (:func:`~.tree_sampled.sampled_tree`) when ``sampled``,
    else (and always when greedy) EAGLE-2's top-K expansion (:func:`~.tree.topk_tree`)."""
    if sampled and not params.greedy:
        return sampled_tree(root, expand, budget, params, generator)
    return topk_tree(root, expand, budget, params)


def new_columns(num_new: torch.Tensor, lengths: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, pos): [A, m]`` of ``m`` columns fed right-aligned: the last ``num_new[a]`` are row
    ``a``'s new tokens (the rest masked holes), at positions ending at ``lengths[a] - 1``."""
    j = torch.arange(m, device=lengths.device)
    valid = (j[None, :] >= (m - num_new)[:, None]).long()
    return valid, (lengths[:, None] - m + j[None, :]).clamp(min=0)
