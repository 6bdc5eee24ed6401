"""Lossless verification of a draft **tree** by sample-then-match (FastGRPO's rule).

The policy scored every node of a row's tree in one forward (column 0 = the row's last emitted
token, the root; column ``i + 1`` = node ``i``, each seeing only its ancestors). At every column
the policy draws one token ``x_c`` from its own processed distribution ``p_c`` (temperature,
top-k, top-p: :func:`~grpo_parts.decoding.sampling_probs`, exactly as the reference sampler).
Walk down from the root: if a child of the current node carries the token ``x_c`` the policy
drew there, move to it (it is accepted) and repeat; otherwise emit ``x_c`` and stop.

**Why it is exact.** Every emitted token is the policy's own draw at the column whose context is
exactly the tokens emitted before it (the accepted path), so the emitted sequence is distributed as
plain sampling, whatever the draft proposed, at any temperature / top-k / top-p; the tree only
decides how many of those draws one forward yields. **Why this rule for trees.** Every built-in
tree is *deterministic* given its context (n-gram branches, EAGLE-2 / small-LM top-K expansion):
the children of a node form a fixed set ``S`` of distinct tokens, and no lossless rule can move on
with probability above ``p(S)`` (the emitted token must be distributed as ``p``); sample-then-match
moves on with probability exactly ``p(S)``, so it is optimal here. Multi-draft recursive rejection
sampling only accepts more when children are *sampled* from ``q``; chains drawn from ``q`` keep
the residual rule (:func:`~grpo_parts.sampler.verify.verify_chain`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..decoding import SamplingParams, draw, sampling_probs

#: ``(logits [A, N+1, V], tokens [A, N], parents [A, N], params, generator)`` ->
#: ``(num_accepted [A], path [A, D] columns of the accepted nodes (valid ``j < num_accepted``),
#: next_token [A])``
TreeVerifier = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, SamplingParams, torch.Generator | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


def policy_draws(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per column from the policy's processed distribution, ``[A, T]`` (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(-1)
    a, t, v = logits.shape
    return draw(sampling_probs(logits, params).reshape(a * t, v), generator).view(a, t)


def verify_tree(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample-then-match down each row's tree; see the module docstring."""
    x = policy_draws(logits, params, generator)  # [A, N+1]
    return _walk(x, tokens, parents, follow_any=False)


def tree_always_accept(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A deliberately **broken** tree verifier (follows each node's first child whatever the policy
    drew, then emits the policy's draw): emits the draft's choices. Tests use it to show that the
    losslessness tests have teeth."""
    x = policy_draws(logits, params, generator)
    return _walk(x, tokens, parents, follow_any=True)


def _walk(
    x: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, follow_any: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, n = tokens.shape
    pcol = parents + 1  # the parent's column
    cur = torch.zeros(a, dtype=torch.long, device=x.device)
    n_acc = torch.zeros_like(cur)
    alive = torch.ones(a, dtype=torch.bool, device=x.device)
    cols: list[torch.Tensor] = []
    for _ in range(n):
        match = (pcol == cur[:, None]) & alive[:, None]
        if not follow_any:
            match &= tokens == x.gather(1, cur[:, None])
        hit = match.any(1)
        if not bool(hit.any()):
            break
        nxt_col = torch.where(hit, match.float().argmax(1) + 1, cur)  # the first matching child
        cols.append(nxt_col)
        n_acc += hit.long()
        alive &= hit
        cur = nxt_col
    path = torch.stack(cols, 1) if cols else torch.zeros(a, 0, dtype=torch.long, device=x.device)
    return n_acc, path, x.gather(1, cur[:, None]).squeeze(1)
