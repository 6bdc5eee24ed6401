"""Logit processing shared by every sampler, so that a speculative sampler's draft and target
distributions are processed *exactly* as the reference sampler processes the policy's."""

from __future__ import annotations

import torch

from .protocol import SamplingParams


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p on ``logits: [..., V]``; removed tokens get ``-inf``.

    Top-p keeps the smallest set of most-likely tokens whose mass reaches ``top_p`` (at least one).
    Ties at the top-k boundary keep every tied token (same rule as transformers).
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if params.temperature > 0.0 and params.temperature != 1.0:
        x = x / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # mass of strictly more-likely tokens
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampler draws from, ``[..., V]`` (one-hot at the argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(
            torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        )
    return torch.softmax(sampling_logits(logits, params), dim=-1)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw one token per row from ``logits: [R, V]`` -> ``[R]`` (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(-1)
    return draw(sampling_probs(logits, params), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``probs: [R, V]`` by inverse CDF: one uniform per row.

    Same distribution as ``torch.multinomial(probs, 1)``, which on CPU draws V exponentials per row
    and is 5-10x slower at V = 8k (it dominated the non-model time of a decode step). The float64
    cumsum keeps rounding far below sampling noise; ``right=True`` never lands on a p = 0 token.
    """
    cdf = probs.double().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
