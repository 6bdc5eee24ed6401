"""``layout="auto"``: grid or padding-free by estimated cost, model tokens plus attention scores.

With the varlen plan (the padding-free ``sdpa`` kernel's cascade, ``eager``'s
:mod:`.varlen_eager`) the padding-free layout never computes more scores than the grid under the
same kernel (every completion padded to at most the grid's longest), so fewer tokens decide; with a
dense per-span mask (``varlen=False``) its ``(P + sum_j S_j)^2`` scores can outweigh the tokens it
saves, and the grid's cascade wins. ``eager`` computes whole score squares (it masks them), the
flash calls causal halves. Scores are weighed against tokens by FLOPs (:func:`score_weight`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..protocol import LogprobBatch
from .chunking import group_sizes
from .padding_free import padding_free_tokens


@dataclass(frozen=True)
class LayoutCost:
    """What a layout runs: model ``tokens`` and attention ``scores`` (per head and layer, as its
    kernel computes them: causal halves where a flash call skips them, whole squares for a mask)."""

    tokens: float
    scores: float = 0.0

    def total(self, score_weight: float) -> float:
        """In token-equivalents: ``tokens + score_weight * scores`` (see :func:`score_weight`)."""
        return self.tokens + score_weight * self.scores


def grid_cost(
    batch: LogprobBatch, chunks: list[torch.Tensor], tokens: float, eager: bool = False
) -> LayoutCost:
    """The grid plan's cost: ``tokens`` (its slots) and, per grid of ``B`` groups, prompt ``Pp``,
    group ``G``, completion ``S``: ``B (Pp^2/2 + G S Pp + G S^2/2)`` cascade scores (``eager``:
    ``B (Pp^2 + G S Pp + G S^2)``, whole squares)."""
    half = 1.0 if eager else 0.5
    scores = 0.0
    for c in chunks:
        _, rows, p, s = group_sizes(batch.select(c))
        if rows.numel():
            pp, g, sl = float(p.max()), float(rows.max()), float(s.max())
            scores += rows.numel() * (half * pp * pp + g * sl * pp + half * g * sl * sl)
    return LayoutCost(tokens, scores)


def padding_free_cost(batch: LogprobBatch, dense: bool, eager: bool = False) -> LayoutCost:
    """The padding-free layout's cost: :func:`padding_free_tokens` and, per group span of prompt
    ``P`` and completions ``S_j``, ``(P + sum S_j)^2`` scores with a ``dense`` mask (masked eager or
    SDPA), ``P^2/2 + sum_j S_j (P + S_j/2)`` (the varlen cascade, flex's block mask) or, ``eager``,
    ``P^2 + sum_j S_j (P + S_j)`` (:mod:`.varlen_eager`: whole squares; bucket padding not counted,
    as for the cascade)."""
    row_group, _, p, _ = group_sizes(batch)
    clen = batch.completion_mask.detach().cpu().double().sum(-1)
    total = torch.zeros(p.numel(), dtype=torch.float64).index_add(0, row_group, clen)
    pf = p.double()
    if dense:
        scores = float(((pf + total) ** 2).sum())
    else:
        half = 1.0 if eager else 0.5
        scores = float((half * pf * pf + pf * total).sum() + (half * clen * clen).sum())
    return LayoutCost(float(padding_free_tokens(batch)), scores)


def score_weight(config: Any) -> float:
    """Token-equivalents of one attention score (per head and layer): a score costs ``4 H d``
    FLOPs (``q.k`` and ``p.v``, ``H`` query heads of size ``d``), a token ``2x`` a decoder layer's
    weights (attention projections + a gated MLP; MoE: the experts a token runs). 0 (tokens only)
    when the config lacks the sizes."""
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return 0.0
    d = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None)
    ffn = (ffn or 4 * hidden) * (getattr(config, "num_experts_per_tok", None) or 1)
    weights = hidden * d * (2 * heads + 2 * kv) + 3 * hidden * ffn
    return 4.0 * heads * d / (2.0 * weights)


def choose_layout(
    requested: str, grid: float | LayoutCost, free: float | LayoutCost, weight: float = 0.0
) -> tuple[str, str]:
    """``(layout, why)``: ``requested`` unless ``"auto"``, which takes the layout of the smaller
    cost ``tokens + weight * scores`` (:class:`LayoutCost`; a number is tokens alone), the grid on
    a tie (its cascade kernels attend to the prefix without a mask)."""
    if requested != "auto":
        return requested, f"layout {requested!r} (requested)"
    g = grid if isinstance(grid, LayoutCost) else LayoutCost(grid)
    f = free if isinstance(free, LayoutCost) else LayoutCost(free)
    gc, fc = g.total(weight), f.total(weight)

    def say(c: LayoutCost, total: float) -> str:
        if not weight:
            return f"{c.tokens:.0f} model tokens"
        return (
            f"cost {total:.0f} ({c.tokens:.0f} model tokens + {weight:.2g} x {c.scores:.3g} attention scores)"
        )

    if fc < gc:
        return "padding_free", f"padding_free: {say(f, fc)} < grid {say(g, gc)}"
    return "grid", f"grid: {say(g, gc)} <= padding_free {say(f, fc)}"


def auto_costs(
    batch: LogprobBatch,
    chunks: list[torch.Tensor],
    grid_slots: float,
    config: Any,
    kernel: str,
    varlen: bool,
) -> tuple[LayoutCost, LayoutCost, float]:
    """``(grid, padding-free, weight)`` for :func:`choose_layout`: the padding-free attention is
    dense with ``varlen=False`` (masked eager or SDPA); ``eager`` computes whole squares."""
    dense, eager = kernel in ("eager", "sdpa") and not varlen, kernel == "eager"
    return (
        grid_cost(batch, chunks, grid_slots, eager),
        padding_free_cost(batch, dense, eager),
        score_weight(config),
    )
