"""Lossless verification of a draft **tree** by sample-then-match (FastGRPO's rule).

At every column the policy draws its own token; walk down while a child carries that token, else
emit it and stop. Every emitted token is the policy's draw in exactly the accepted context, so the
output is plain sampling at any temperature / top-k / top-p, and for deterministic trees the rule is
optimal. Sampled trees use recursive rejection sampling without replacement
(:func:`verify_sampled_tree`, Jeon et al. 2024). docs/speculative.md, "Draft trees".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...decoding import SamplingParams, draw, sampling_probs

#: ``(logits [A, N+1, V], tokens [A, N], parents [A, N], params, generator)`` ->
#: ``(num_accepted [A], path [A, D] columns of the accepted nodes (valid ``j < num_accepted``),
#: next_token [A])``
TreeVerifier = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, SamplingParams, torch.Generator | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
#: a :data:`TreeVerifier` that also takes ``probs=`` (keyword): ``[A, N, V]`` the ``q`` each node
#: was drawn from; the sampler binds it per step for sampled trees
SampledTreeVerifier = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def policy_draws(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per column from the policy's processed distribution, ``[A, T]`` (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(-1)
    a, t, v = logits.shape
    return draw(sampling_probs(logits, params).reshape(a * t, v), generator).view(a, t)


def verify_tree(
    logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sample-then-match down each row's tree; see the module docstring."""
    x = policy_draws(logits, params, generator)  # [A, N+1]
    return walk_tree(x, tokens, parents, follow_any=False)


def walk_tree(
    x: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, follow_any: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk down each row's tree given the policy's draws ``x: [A, N+1]`` (one per column):
    move to the first child whose token is the draw at the current column (``follow_any``: to the
    first child, whatever was drawn). ``tokens``/``parents: [A, N]``. Returns ``(num_accepted [A],
    path [A, D], next_token [A])`` as a :data:`TreeVerifier`."""
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


def verify_sampled_tree(
    logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | None = None, *, probs: torch.Tensor, renormalize_q: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Recursive rejection sampling without replacement down each row's sampled tree (the rule and
    why it is exact: docs/speculative.md, "Sampled trees"). A child with no ``q`` mass left (drawn
    past ``q``'s support) is skipped; with one child this is
    :func:`~grpo_parts.sampler.speculative.verify.verify_chain`'s residual rule.
    ``renormalize_q=False`` keeps a rejected child's ``q`` mass (wrong: the tests' negative control)."""
    if params.greedy:  # q is a point mass at each drawn child: RRS is sample-then-match
        return verify_tree(logits, tokens, parents, params, generator)
    a, n = tokens.shape
    dev = logits.device
    p_all = sampling_probs(logits, params).double()  # [A, N+1, V]
    q_all = probs.double()
    pcol = parents + 1
    # each node's rank among its siblings (node order = draw order)
    same = pcol[:, :, None] == pcol[:, None, :]  # [A, N, N]
    sib = (same & torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)).sum(-1)
    width = int(sib.max()) + 1 if n else 0
    rows = torch.arange(a, device=dev)
    cur = torch.zeros(a, dtype=torch.long, device=dev)
    n_acc, alive = torch.zeros_like(cur), torch.ones(a, dtype=torch.bool, device=dev)
    final = p_all[:, 0].clone()
    cols: list[torch.Tensor] = []
    for _ in range(n + 1):
        kids = (pcol == cur[:, None]) & alive[:, None]  # [A, N]
        p_r = p_all[rows, cur]
        q_r = q_all[rows, kids.float().argmax(1)]  # every child of ``cur`` was drawn from it
        moved = torch.zeros_like(alive)
        nxt = cur.clone()
        for r in range(width):
            m = kids & (sib == r)
            idx = m.float().argmax(1)
            x = tokens[rows, idx]
            qx, px = q_r[rows, x], p_r[rows, x]
            tried = m.any(1) & ~moved & (qx > 0)
            u = torch.rand(a, generator=generator, device=dev, dtype=torch.float64)
            acc = tried & (u * qx < px)
            moved |= acc
            nxt = torch.where(acc, idx + 1, nxt)
            rej = (tried & ~acc)[:, None]
            resid = (p_r - q_r).clamp(min=0.0)
            mass = resid.sum(-1, keepdim=True)
            # mass 0 only by rounding (p == q never rejects): keep p there
            p_r = torch.where(rej & (mass > 1e-12), resid / mass.clamp(min=1e-300), p_r)
            if renormalize_q:
                q_del = q_r.scatter(1, x[:, None], 0.0)
                q_r = torch.where(rej, q_del / q_del.sum(-1, keepdim=True).clamp(min=1e-300), q_r)
        stop = alive & ~moved
        final = torch.where(stop[:, None], p_r, final)
        if not bool(moved.any()):
            break
        cols.append(nxt)
        n_acc += moved.long()
        alive &= moved
        cur = nxt
    path = torch.stack(cols, 1) if cols else torch.zeros(a, 0, dtype=torch.long, device=dev)
    return n_acc, path, draw(final, generator)
