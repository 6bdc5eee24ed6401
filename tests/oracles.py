"""Deliberately **broken** verifiers, for tests only: each emits the draft's distribution (or a
wrong residual), not the policy's, so a losslessness test that passes them has no teeth.

Drop-in replacements for the speculative sampler's ``verifier=`` / ``sampled_verifier=`` arguments
(:data:`~grpo_parts.sampler.speculative.verify.Verifier`,
:data:`~grpo_parts.sampler.speculative.tree_verify.TreeVerifier`).
"""

from __future__ import annotations

import torch

from grpo_parts.decoding import SamplingParams, sampling_probs
from grpo_parts.sampler.speculative.tree_verify import policy_draws, verify_sampled_tree, walk_tree

__all__ = ["always_accept", "rrs_without_q_update", "tree_always_accept"]


def always_accept(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A broken chain verifier (accepts every draft token, bonus from ``p_k``): emits the draft's
    distribution, not the policy's. ``logits: [A, k+1, V]``, ``draft_tokens: [A, k]`` ->
    ``(num_accepted [A] == k, next_token [A])``."""
    a, k = draft_tokens.shape
    p = sampling_probs(logits[:, k], params)
    tok = p.argmax(-1) if params.greedy else torch.multinomial(p, 1, generator=generator).squeeze(-1)
    return torch.full((a,), k, dtype=torch.long, device=logits.device), tok


def tree_always_accept(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A broken tree verifier (follows each node's first child whatever the policy drew, then emits
    the policy's draw): emits the draft's choices. ``logits: [A, N+1, V]``, ``tokens``/``parents:
    [A, N]`` -> ``(num_accepted [A], path [A, D], next_token [A])``."""
    x = policy_draws(logits, params, generator)
    return walk_tree(x, tokens, parents, follow_any=True)


def rrs_without_q_update(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A wrong sampled-tree verifier (after a rejection ``q`` keeps the tried child's mass, as if the
    children were drawn *with* replacement): the chi-square tests must reject it."""
    return verify_sampled_tree(logits, tokens, parents, params, generator, probs=probs, renormalize_q=False)
