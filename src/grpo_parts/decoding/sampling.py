"""How to sample (:class:`SamplingParams`), the logit processing every sampler and draft applies, and
drawing from it."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How to sample. ``temperature == 0`` means greedy. Processing order (as in transformers):
    temperature, then top-k (``0`` = off), then top-p (``1.0`` = off).

    Returned log-probs are ``log_softmax(logits / temperature)`` of the emitted token (temperature 1
    when greedy), without top-k/top-p: the convention TRL and verl use for the training loss.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(1, ge=1, description="completions per prompt (G)")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = Field(0, ge=0)

    @field_validator("eos_token_ids")
    @classmethod
    def _eos_nonneg(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in v):
            raise ValueError(f"eos_token_ids: expected non-negative token ids, got {v}")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


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
    and dominated the non-model time of a decode step (docs/results.md, Sampler). The float64
    cumsum keeps rounding far below sampling noise; ``right=True`` never lands on a p = 0 token.
    """
    cdf = probs.double().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
