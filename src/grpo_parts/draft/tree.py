"""Building draft trees: EAGLE-2-style top-K expansion for the model drafts (EAGLE head, small LM).

:func:`topk_tree` keeps the ``K`` best tokens of every level (cumulative draft log-probability) as the
next frontier, feeding each frontier node to the draft once (:class:`Frontier`), then keeps the best
``N`` candidates (closed under ancestors: a child never scores above its parent). The tree is
deterministic given the context, so sample-then-match verifies it losslessly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..decoding import SamplingParams, sampling_logits
from .protocol import DraftProposal, TreeBudget


@dataclass(frozen=True)
class Frontier:
    """Nodes to feed to the draft at one level. ``tokens: [A, F]`` their tokens at ``depth`` (children of the
    root: 1); ``fed_parent: [A, F]`` each node's parent among the nodes fed before (index into the feeding
    order, ``-1`` = the root); ``anc: [A, F, M]`` ancestors-or-self among all ``M`` nodes fed so far, these
    included (they come last); ``paths: [A, F, depth]`` the tokens from the root down to each node."""

    tokens: torch.Tensor
    depth: int
    fed_parent: torch.Tensor
    anc: torch.Tensor
    paths: torch.Tensor


#: ``expand(frontier) -> logits [A, F, V]``: the draft's next-token logits at each frontier node
Expand = Callable[[Frontier], torch.Tensor]


def ranking_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities a tree is ranked by: the draft's processed distribution (temperature,
    top-k, top-p as the policy's), or the raw one when greedy (a one-hot would not rank)."""
    x = logits if params.greedy else sampling_logits(logits, params)
    return torch.log_softmax(x.float(), -1)


def topk_tree(
    root_logits: torch.Tensor, expand: Expand, budget: TreeBudget, params: SamplingParams
) -> DraftProposal:
    """An EAGLE-2 tree of ``budget.nodes`` nodes per row from the root's draft logits ``[A, V]``."""
    a, v = root_logits.shape
    dev = root_logits.device
    k = min(budget.width, v)
    score, tok = ranking_logprobs(root_logits, params).topk(k, -1)  # [A, K]
    toks, scores, parents = [tok], [score], [torch.full((a, k), -1, dtype=torch.long, device=dev)]
    paths = tok[..., None]
    anc = torch.zeros(a, 0, 0, dtype=torch.bool, device=dev)  # among fed nodes
    fed_parent = torch.full((a, k), -1, dtype=torch.long, device=dev)
    # all ``depth`` levels are grown even when the first levels already hold ``nodes`` candidates:
    # a deep path of confident tokens outranks a level's weak siblings in the final selection
    for depth in range(1, budget.depth):
        m0 = anc.shape[1]
        # the new fed nodes see their parent's ancestors and themselves
        par_anc = torch.where(
            fed_parent[..., None] >= 0,
            anc.gather(1, fed_parent.clamp(min=0)[..., None].expand(-1, -1, m0)),
            torch.zeros(a, k, m0, dtype=torch.bool, device=dev),
        )
        new_anc = torch.cat([par_anc, torch.eye(k, dtype=torch.bool, device=dev).expand(a, -1, -1)], 2)
        anc = torch.cat([torch.nn.functional.pad(anc, (0, k)), new_anc], 1)
        logits = expand(Frontier(toks[-1], depth, fed_parent, new_anc, paths))  # [A, K, V]
        child = scores[-1][..., None] + ranking_logprobs(logits, params)  # [A, K, V]
        score, flat = child.reshape(a, -1).topk(k, -1)
        src = flat // v  # which frontier node each child hangs from
        base = sum(t.shape[1] for t in toks[:-1])
        toks.append(flat % v)
        scores.append(score)
        parents.append(base + src)
        fed_parent = m0 + src  # the frontier just fed occupies feeding slots m0 .. m0 + K - 1
        paths = torch.cat(
            [paths.gather(1, src[..., None].expand(-1, -1, paths.shape[2])), toks[-1][..., None]], 2
        )
    tok_all, score_all, par_all = torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1)
    n = min(budget.nodes, tok_all.shape[1])
    # best n by score; stable on candidate order, so a parent (earlier) wins a tie with its child
    keep = torch.sort(-score_all, dim=1, stable=True).indices[:, :n].sort(1).values
    new_index = torch.full_like(par_all, -1).scatter_(1, keep, torch.arange(n, device=dev).expand(a, -1))
    par = par_all.gather(1, keep)
    par = torch.where(par >= 0, new_index.gather(1, par.clamp(min=0)), par)
    return DraftProposal(tok_all.gather(1, keep), None, par)
