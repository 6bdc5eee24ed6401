"""Decoding primitives shared by the samplers (``grpo_parts.sampler``) and the drafts
(``grpo_parts.draft``), so that neither package imports the other's internals:

* :class:`SamplingParams` -- how to sample (re-exported by ``grpo_parts.sampler.protocol``);
* the logit processing every sampler and draft applies (:func:`sampling_probs`: temperature, then
  top-k, then top-p, exactly as the reference sampler), and drawing from it (:func:`draw`);
* :func:`collector_paused`: automatic garbage collection off for one decode loop;
* KV-cache row operations on right-aligned rows with masked *holes* (:func:`right_align`,
  :func:`compact_cache`); the cache-class differences across transformers releases stay in
  :mod:`grpo_parts.compat`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .compat import cache_layers

__all__ = [
    "SamplingParams",
    "collector_paused",
    "compact_cache",
    "draw",
    "right_align",
    "sample_tokens",
    "sampling_logits",
    "sampling_probs",
]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for one decode loop, restored after (left off where
    the caller had turned it off). A decode step creates tensors freed by reference counting, not
    cycles, yet allocating them triggers collections of everything the process holds: in the main
    job a full collection took up to 0.68 s inside a decode step, and the speculative sampler's
    measured step times, which choose its draft sizes, took it for the cost of speculating."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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


# ---------------------------------------------------------------- logit processing
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


# ---------------------------------------------------------------- cache rows
def right_align(buf: torch.Tensor, ends: torch.Tensor, width: int, fill: int | float) -> torch.Tensor:
    """Row ``a`` of ``buf: [A, W, ...]`` has its real entries ending (exclusive) at ``ends[a]``;
    return ``[A, width, ...]`` with those entries shifted to end at ``width``."""
    shift = width - ends  # [A]
    src = torch.arange(width, device=buf.device)[None, :] - shift[:, None]
    valid = src >= 0
    src = src.clamp(min=0, max=buf.shape[1] - 1)
    idx = src.view(*src.shape, *([1] * (buf.ndim - 2))).expand(-1, -1, *buf.shape[2:])
    out = buf.gather(1, idx)
    return out.masked_fill(~valid.view(*valid.shape, *([1] * (buf.ndim - 2))), fill)


def compact_cache(cache: Any, mask: torch.Tensor, start: int = 0) -> torch.Tensor | None:
    """Gather each row's live KV entries (``mask == 1``) among columns ``>= start`` to the right end
    of the cache, in order; columns ``< start`` stay where they are (the speculative sampler keeps
    the prompt's columns in place so its decode attention can read them once per group). Returns
    the new mask, or None when the cache type has no ``layers[i].keys/values``."""
    layers = cache_layers(cache)
    if layers is None:
        return None
    tail = mask[:, start:]
    width = int(tail.sum(-1).max())
    # holes first, then live in order
    idx = start + torch.sort(tail, dim=-1, stable=True).indices[:, tail.shape[1] - width :]
    for ly in layers:
        if not getattr(ly, "is_initialized", True) or ly.keys.numel() == 0:
            continue
        g = idx[:, None, :, None].expand(-1, ly.keys.shape[1], -1, ly.keys.shape[-1])
        keys, values = ly.keys.gather(2, g), ly.values.gather(2, g)
        if start > 0:
            keys = torch.cat([ly.keys[:, :, :start], keys], 2)
            values = torch.cat([ly.values[:, :, :start], values], 2)
        ly.keys, ly.values = keys, values
        if hasattr(ly, "cumulative_length"):  # sliding-window layers size their masks from it
            ly.cumulative_length = ly.keys.shape[-2]
    return torch.cat([mask[:, :start], mask.gather(1, idx)], 1)


# ---------------------------------------------------------------- draft trees
def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``parents: [A, N]`` (node ``i``'s parent node, ``-1`` = the root, always ``< i``) ->
    ``anc: [A, N + 1, N + 1]`` bool, ``anc[a, i, j]`` = column ``j`` is column ``i`` or one of its
    ancestors, where column 0 is the root (the row's last token) and column ``i + 1`` is node ``i``.

    Walks every column up to the root at once, one level per iteration (trees are shallow: the loop
    runs depth + 1 times, not N times)."""
    a, n = parents.shape
    dev = parents.device
    anc = torch.eye(n + 1, dtype=torch.bool, device=dev).expand(a, -1, -1).clone()
    up = torch.cat(
        [torch.zeros(a, 1, dtype=torch.long, device=dev), parents + 1], 1
    )  # column -> parent column
    cur = up
    for _ in range(n):
        anc.scatter_(2, cur[..., None], True)
        if not bool(cur.any()):  # every column reached the root
            break
        cur = up.gather(1, cur)
    return anc


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (children of the root: 1), ``[A, N]``."""
    return tree_ancestors(parents)[:, 1:].sum(-1) - 1


def tree_attention_mask(past: torch.Tensor, anc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask ``[A, 1, T, P + T]`` for a cached forward of a tree block: every query sees
    the live past columns (``past: [A, P]``, 1 = live) and its own ancestors-or-self in the block
    (``anc: [A, T, T]``). Float (0 / dtype min): eager adds it, SDPA takes it as is."""
    a, t = anc.shape[:2]
    allowed = torch.cat([past.bool()[:, None, :].expand(a, t, -1), anc], -1)
    out = torch.zeros(allowed.shape, dtype=dtype, device=past.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def compact_block(cache: Any, order: torch.Tensor, keep: int | None = None) -> bool:
    """Reorder the last ``B`` cache columns of every row by ``order: [A, B]`` (column indices into
    the block), in place: used to move a verified tree's accepted path to the front of its block
    so the rest can be cropped. With ``keep``, only the block's first ``keep`` columns are written
    (the rest are about to be cropped or masked). False when the cache type has no
    ``layers[i].keys/values``."""
    layers = cache_layers(cache)
    if layers is None:
        return False
    b = order.shape[1]
    m = b if keep is None else min(max(keep, 0), b)
    if m == 0:
        return True
    order = order[:, :m]
    for ly in layers:
        if not getattr(ly, "is_initialized", True) or ly.keys.numel() == 0:
            continue
        g = order[:, None, :, None].expand(-1, ly.keys.shape[1], -1, ly.keys.shape[-1])
        end = ly.keys.shape[2] - b + m
        ly.keys[:, :, -b:end] = ly.keys[:, :, -b:].gather(2, g)
        ly.values[:, :, -b:end] = ly.values[:, :, -b:].gather(2, g)
    return True
