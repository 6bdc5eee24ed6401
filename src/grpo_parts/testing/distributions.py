"""Helpers for statistical equivalence tests of samplers (reference, speculative, vLLM).

A sampler is correct when its sequences are distributed exactly as plain sampling (temperature, then
top-k, then top-p). On a tiny-vocabulary model :func:`sequence_distribution` enumerates that
distribution (with :func:`processed_probs`, an independent NumPy logit processing) and
:func:`chi_square_gof` tests samples against it::

    probs = sequence_distribution(model, prompt, length=2, temperature=1.0)   # [V**2]
    codes = encode_sequences(rollout.completion_ids[:, :2], vocab_size)        # [N]
    assert chi_square_gof(codes, probs) > 1e-3

scipy is needed for the p-value (it is in the ``dev`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import GRPOPartsError


def processed_probs(
    logits: np.ndarray | torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """The sampling distribution over the last axis, computed independently in float64 NumPy:
    temperature scales logits; top-k keeps tokens whose logit is >= the k-th largest (ties kept); top-p
    keeps the smallest prefix of tokens sorted by probability whose mass reaches ``top_p`` (a token is
    kept when the mass of strictly more-likely tokens is < ``top_p``); ``temperature == 0``: argmax."""
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().double().cpu().numpy()
    x = np.asarray(logits, np.float64)
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros_like(flat)
    for r, row in enumerate(flat):
        if temperature == 0.0:
            out[r, int(np.argmax(row))] = 1.0
            continue
        z = row / temperature
        keep = np.ones(z.shape, dtype=bool)
        if 0 < top_k < z.size:
            kth = np.sort(z)[::-1][top_k - 1]
            keep &= z >= kth
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        if top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            before = np.cumsum(p[order]) - p[order]
            drop = np.zeros(z.shape, dtype=bool)
            drop[order[1:]] = before[1:] >= top_p
            p = np.where(drop, 0.0, p)
            p /= p.sum()
        out[r] = p
    return out.reshape(x.shape)


@torch.no_grad()
def sequence_distribution(
    model: torch.nn.Module,
    prompt: Sequence[int],
    length: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_sequences: int = 1 << 16,
    images: Mapping[str, torch.Tensor] | None = None,
) -> np.ndarray:
    """Exact probability of every length-``length`` continuation of ``prompt`` (no EOS), ``[V**length]``.
    Entry ``encode(t_1..t_L)`` (see :func:`encode_sequences`) is ``prod_i p(t_i | prompt, t_<i)`` with each
    step's distribution from :func:`processed_probs` applied to a plain full forward (no KV cache) of
    ``prompt + t_1..t_L``; ``images``: the prompt's image keywords (a VLM), given with every sequence, at
    the positions generation uses. A continuation holding an image placeholder token is not forwarded (the
    model would take it for an image): it gets probability 0, so give a model that cannot emit those."""
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator, union-attr]
    n = vocab**length
    if n > max_sequences:
        raise GRPOPartsError(
            f"length: {vocab}**{length} = {n} sequences, expected <= max_sequences={max_sequences}"
        )
    device = next(model.parameters()).device
    conts = torch.as_tensor(decode_sequences(np.arange(n), vocab, length), device=device)  # [n, L]
    ids = torch.cat([torch.as_tensor(prompt, device=device).expand(n, -1), conts], dim=1)
    skipped = np.zeros(n, dtype=bool)
    if images:
        logits, skipped = _image_prompt_logits(model, ids, len(prompt), images)
    else:
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]  # [n, L, V]: predicts t_1..t_L
    step = processed_probs(logits, temperature, top_k, top_p)  # [n, L, V]
    picked = np.take_along_axis(step, conts.cpu().numpy()[..., None], axis=-1)[..., 0]  # [n, L]
    probs = np.where(skipped, 0.0, picked.prod(-1))
    return probs / probs.sum()


def encode_sequences(tokens: torch.Tensor | np.ndarray, vocab_size: int) -> np.ndarray:
    """``[N, L]`` token ids -> ``[N]`` category codes ``sum_i t_i * V**(L-1-i)`` (first token most significant)."""
    t = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    codes = np.zeros(t.shape[0], dtype=np.int64)
    for i in range(t.shape[1]):
        codes = codes * vocab_size + t[:, i].astype(np.int64)
    return codes


def decode_sequences(codes: np.ndarray, vocab_size: int, length: int) -> np.ndarray:
    """Inverse of :func:`encode_sequences`: ``[N]`` -> ``[N, length]``."""
    out = np.zeros((len(codes), length), dtype=np.int64)
    c = np.asarray(codes, dtype=np.int64).copy()
    for i in range(length - 1, -1, -1):
        out[:, i] = c % vocab_size
        c //= vocab_size
    return out


def chi_square_gof(
    samples: Sequence[int] | np.ndarray | torch.Tensor, probs: np.ndarray, min_expected: float = 5.0
) -> float:
    """p-value of Pearson's chi-square goodness-of-fit test of category ``samples`` against ``probs``.
    Categories with expected count < ``min_expected`` are pooled (the test's usual validity rule). A sample
    in a category of probability exactly 0 (e.g. a token top-k removed) returns 0.0: no amount of luck
    explains it. Returns 1.0 when pooling leaves a single category."""
    from scipy.stats import chisquare

    s = samples.cpu().numpy() if isinstance(samples, torch.Tensor) else np.asarray(samples)
    p = np.asarray(probs, dtype=np.float64)
    if s.size == 0:
        raise GRPOPartsError("samples: expected at least one sample, got none")
    if s.min() < 0 or s.max() >= p.size:
        raise GRPOPartsError(f"samples: expected categories in [0, {p.size}), got [{s.min()}, {s.max()}]")
    obs = np.bincount(s, minlength=p.size).astype(np.float64)
    if obs[p <= 0].sum() > 0:
        return 0.0
    exp = p / p.sum() * s.size
    big = exp >= min_expected
    obs_b, exp_b = list(obs[big]), list(exp[big])
    rest_exp = exp[~big & (p > 0)].sum()
    if rest_exp > 0:
        obs_b.append(obs[~big & (p > 0)].sum())
        exp_b.append(rest_exp)
    if len(exp_b) < 2:
        return 1.0
    return float(chisquare(obs_b, exp_b).pvalue)


def record_proposals(draft: Any, run: Callable[[], object]) -> list[torch.Tensor]:
    """Call ``run()`` with ``draft.propose`` wrapped; return the draft distribution ``probs`` of
    every proposal it made, in order (to compare two drafts, or two code paths, on the same run)."""
    seen: list[torch.Tensor] = []
    propose = draft.propose

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = propose(*args, **kwargs)
        seen.append(out.probs.clone())
        return out

    draft.propose = spy
    try:
        run()
    finally:
        del draft.propose
    return seen


def _image_prompt_logits(
    model: torch.nn.Module, ids: torch.Tensor, prompt_len: int, images: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, np.ndarray]:
    """:func:`sequence_distribution`'s ``[n, L, V]`` logits for a VLM prompt with ``images``, and
    which continuations hold a placeholder token (not forwarded: their logits are 0)."""
    from ..attention.vision import placeholder_ids, row_positions

    placeholder = torch.isin(ids[:, prompt_len:], placeholder_ids(model).to(ids.device)).any(-1)
    rows = (~placeholder).nonzero().flatten()
    each = {k: torch.cat([v.to(ids.device)] * int(rows.numel())) for k, v in images.items()}
    pos, _ = row_positions(model, ids[rows], torch.ones_like(ids[rows]), each)
    kept = model(input_ids=ids[rows], position_ids=pos, **each).logits[:, prompt_len - 1 : -1]
    out = kept.new_zeros((ids.shape[0], *kept.shape[1:]))
    out[rows] = kept
    return out, placeholder.cpu().numpy()
