"""Lossless verification of a drafted chain (Leviathan et al. 2023, Chen et al. 2023).

``d_j ~ q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the
row emits one token from ``norm(max(0, p_j - q_j))``, else a bonus token from ``p_k``. ``p`` is
:func:`~grpo_parts.decoding.sampling_probs` (the reference sampler's processing); ``q=None`` is a
deterministic draft (a point mass).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...decoding import SamplingParams, sampling_probs

#: ``(logits [A, k+1, V], draft_tokens [A, k], draft_probs [A, k, V] | None, params, generator)``
#: -> ``(num_accepted [A], next_token [A])``
Verifier = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, SamplingParams, torch.Generator | None],
    tuple[torch.Tensor, torch.Tensor],
]


def verify_chain(
    logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
    params: SamplingParams, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Residual rejection sampling. Returns ``num_accepted: [A]`` (leading draft tokens kept) and
    ``next_token: [A]`` (the correction at the first rejection, or the bonus token)."""
    a, k = draft_tokens.shape
    if params.greedy:
        target = logits.argmax(-1)  # [A, k+1]
        match = draft_tokens == target[:, :k]
        n = match.long().cumprod(-1).sum(-1)
        return n, target.gather(1, n[:, None]).squeeze(1)
    p = sampling_probs(logits, params)  # [A, k+1, V]
    if k == 0:
        return torch.zeros(a, dtype=torch.long, device=logits.device), _draw(p[:, 0], generator)
    p_d = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [A, k]
    q_d = (
        torch.ones_like(p_d)
        if draft_probs is None
        else draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).to(p_d.dtype)
    )
    u = torch.rand((a, k), generator=generator, device=logits.device, dtype=p_d.dtype)
    accept = u * q_d < p_d  # u < p/q without dividing (q > 0 wherever the draft could draw d)
    n = accept.long().cumprod(-1).sum(-1)
    # distribution of the token emitted after the n accepted ones
    rows = torch.arange(a, device=logits.device)
    p_n = p[rows, n]  # [A, V]
    nn = n.clamp(max=k - 1)
    if draft_probs is None:
        q_n = torch.nn.functional.one_hot(draft_tokens[rows, nn], p.shape[-1]).to(p.dtype)
    else:
        q_n = draft_probs[rows, nn].to(p.dtype)
    resid = (p_n - q_n).clamp(min=0.0)
    mass = resid.sum(-1, keepdim=True)
    # rejected -> residual; all accepted -> bonus from p_k. A residual with no mass can only come
    # from rounding (p == q rejects with probability 0); fall back to p there.
    rejected = (n < k)[:, None] & (mass > 1e-12)
    dist = torch.where(rejected, resid / mass.clamp(min=1e-30), p_n)
    return n, _draw(dist, generator)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
