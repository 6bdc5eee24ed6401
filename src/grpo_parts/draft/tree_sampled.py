"""Draft trees whose children are **sampled** from the draft (EAGLE head, small LM).

:func:`tree_shape` fixes the shape (rank paths, Sequoia-style) *before* anything is drawn; each
node's ``w`` children are then drawn without replacement from ``q`` (Gumbel-top-``w``). The shape
must not depend on drawn values, or recursive rejection sampling would no longer emit the policy's
``p`` (EAGLE-2's best-``N`` selection fails the tests). docs/speculative.md, "Sampled trees".
"""

from __future__ import annotations

import heapq

import torch

from ..decoding import SamplingParams, sampling_probs
from .protocol import DraftProposal, TreeBudget
from .tree import Expand, Frontier

#: estimated probability that the ``r``-th drawn child (r = 1, 2, ..) is the accepted one, given its
#: parent was reached; only the order of the products matters (the shape's node choice). With a
#: draft that accepts ~0.8 per chain level, a second draw adds ~0.1 and later draws less.
ACCEPT_PROFILE = (0.8, 0.12, 0.05, 0.02, 0.01, 0.005, 0.0025, 0.00125)


def tree_shape(budget: TreeBudget, vocab: int) -> tuple[list[int], list[int]]:
    """``(parents, depths)`` of the fixed-shape tree: the ``budget.nodes`` rank paths of highest
    profile product (depth <= ``budget.depth``, at most ``min(budget.width, vocab)`` children per
    node), in breadth-first order with siblings in rank (draw) order."""
    width = min(budget.width, vocab, len(ACCEPT_PROFILE))
    # greedy best-first: a node's first child and next sibling become candidates once it is taken;
    # products never grow down or across, so the chosen set is closed under parents and lower ranks
    heap = [(-ACCEPT_PROFILE[0], 0, -1, 0, 1)]  # (-score, tiebreak, parent, rank, depth)
    chosen: list[tuple[int, int, int]] = []  # (parent in chosen order, rank, depth)
    count = 1
    while heap and len(chosen) < budget.nodes:
        neg, _, par, rank, depth = heapq.heappop(heap)
        me = len(chosen)
        chosen.append((par, rank, depth))
        if depth < budget.depth:
            heapq.heappush(heap, (neg * ACCEPT_PROFILE[0], count, me, 0, depth + 1))
            count += 1
        if rank + 1 < width:
            score = -neg / ACCEPT_PROFILE[rank] * ACCEPT_PROFILE[rank + 1]
            heapq.heappush(heap, (-score, count, par, rank + 1, depth))
            count += 1
    kids: list[list[int]] = [[] for _ in range(len(chosen) + 1)]  # by chosen index + 1 (0: root)
    for i, (par, _rank, _) in sorted(enumerate(chosen), key=lambda x: x[1][1]):
        kids[par + 1].append(i)
    order: list[int] = []  # breadth-first from the root
    frontier = kids[0]
    while frontier:
        order += frontier
        frontier = [c for i in frontier for c in kids[i + 1]]
    new = {old: j for j, old in enumerate(order)}
    parents = [new[chosen[i][0]] if chosen[i][0] >= 0 else -1 for i in order]
    return parents, [chosen[i][2] for i in order]


def draw_without_replacement(q: torch.Tensor, w: int, generator: torch.Generator | None) -> torch.Tensor:
    """``w`` sequential draws without replacement from ``q: [..., V]``, in draw order (Gumbel-top-w).
    Past the support of ``q`` the draws are arbitrary zero-probability tokens (the verifier skips
    children with no draft probability left)."""
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp(1e-300, 1.0 - 1e-16)))
    return (q.double().log() + gumbel).topk(w, -1).indices


def sampled_tree(
    root_logits: torch.Tensor, expand: Expand, budget: TreeBudget, params: SamplingParams,
    generator: torch.Generator | None,
) -> DraftProposal:  # fmt: skip
    """A fixed-shape tree (:func:`tree_shape`) of sampled children from the root's draft logits
    ``[A, V]``; ``probs[:, i]`` is the ``q`` node ``i`` was drawn from (its parent's)."""
    a, v = root_logits.shape
    dev = root_logits.device
    parents, depths = tree_shape(budget, v)
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i, par in enumerate(parents):
        kids[par + 1].append(i)
    tokens = torch.zeros(a, n, dtype=torch.long, device=dev)
    probs = torch.zeros(a, n, v, dtype=torch.float32, device=dev)

    def draw_children(q: torch.Tensor, owners: list[int]) -> None:  # q: [A, F, V] at owners
        drawn = draw_without_replacement(q, max(len(kids[o + 1]) for o in owners), generator)
        for f, o in enumerate(owners):
            ch = kids[o + 1]
            tokens[:, ch] = drawn[:, f, : len(ch)]
            probs[:, ch] = q[:, f, None].float()

    draw_children(sampling_probs(root_logits, params)[:, None], [-1])
    slot: dict[int, int] = {}  # node -> feeding slot
    for depth in range(1, budget.depth):
        level = [i for i in range(n) if depths[i] == depth and kids[i + 1]]
        if not level:
            break
        m0 = len(slot)
        slot.update({i: m0 + f for f, i in enumerate(level)})
        anc = torch.zeros(len(level), len(slot), dtype=torch.bool, device=dev)
        paths = torch.zeros(len(level), depth, dtype=torch.long)  # node indices root -> node
        for f, i in enumerate(level):
            j, d = i, depth
            while j >= 0:
                anc[f, slot[j]] = True
                paths[f, d - 1] = j
                j, d = parents[j], d - 1
        fed_parent = torch.tensor([slot.get(parents[i], -1) for i in level], device=dev)
        path_tokens = tokens[:, paths.reshape(-1).to(dev)].view(a, len(level), depth)
        fr = Frontier(tokens[:, level], depth, fed_parent.expand(a, -1), anc.expand(a, -1, -1), path_tokens)
        draw_children(sampling_probs(expand(fr), params), level)
    shape = torch.tensor(parents, dtype=torch.long, device=dev).expand(a, -1)
    return DraftProposal(tokens, probs, shape, sampled=True)
