"""``layout="auto"``: grid or padding-free by estimated cost, model tokens plus attention scores
weighed by FLOPs (:func:`score_weight`). With the varlen kernels the padding-free layout never
computes more scores than the grid, so tokens decide; with a dense per-span mask (``varlen=False``)
its scores can outweigh the tokens it saves. docs/attention.md, "Which layout runs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...compat import config_values
from .facts import GroupFacts
from .layout import LayoutSettings


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
    facts: GroupFacts, chunks: list[torch.Tensor], tokens: float, eager: bool = False
) -> LayoutCost:
    """The grid plan's cost (``facts``: the groups the grids share prefixes over; ``chunks``: row
    indices of each grid, whole groups): ``tokens`` (its slots) and, per grid of ``B`` groups,
    prompt ``Pp``, group ``G``, completion ``S``: ``B (Pp^2/2 + G S Pp + G S^2/2)`` cascade scores
    (``eager``: ``B (Pp^2 + G S Pp + G S^2)``, whole squares)."""
    half = 1.0 if eager else 0.5
    scores = 0.0
    for c in chunks:
        c = c.cpu()
        if c.numel():
            sizes = torch.unique(facts.row_group[c], return_counts=True)[1]
            pp, sl = float(facts.prompt_row[c].max()), float(facts.completion[c].max())
            g = float(sizes.max())
            scores += sizes.numel() * (half * pp * pp + g * sl * pp + half * g * sl * sl)
    return LayoutCost(tokens, scores)


def padding_free_cost(f: GroupFacts, dense: bool, eager: bool = False) -> LayoutCost:
    """The padding-free layout's cost: ``f.padding_free_tokens`` and, per group span of prompt
    ``P`` and completions ``S_j``, ``(P + sum S_j)^2`` scores with a ``dense`` mask (masked eager or
    SDPA), ``P^2/2 + sum_j S_j (P + S_j/2)`` (the varlen cascade, flex's block mask) or, ``eager``,
    ``P^2 + sum_j S_j (P + S_j)`` (:mod:`.varlen_eager`: whole squares; bucket padding not counted,
    as for the cascade)."""
    clen = f.completion.double()
    total = torch.zeros(f.prompt.numel(), dtype=torch.float64).index_add(0, f.row_group, clen)
    pf = f.prompt.double()
    if dense:
        scores = float(((pf + total) ** 2).sum())
    else:
        half = 1.0 if eager else 0.5
        scores = float((half * pf * pf + pf * total).sum() + (half * clen * clen).sum())
    return LayoutCost(float(f.padding_free_tokens), scores)


def _ints(config: Any, key: str, layers: int) -> list[int | None]:
    """``key`` per decoder layer: a per-layer config's values, a list field's (Gemma 3n's
    ``intermediate_size``), or the global value repeated; None where it is not a positive int."""
    vals = config_values(config, key)
    if len(vals) == 1 and isinstance(vals[0], (list, tuple)) and len(vals[0]) == layers:
        vals = list(vals[0])
    if len(vals) != layers:
        vals = [vals[0]] * layers
    return [v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None for v in vals]


#: per-layer-type fields of configs that predate ``per_layer_config`` (Gemma 4 up to transformers
#: 5.15): field -> (its value on full-attention layers, the flag that must be set for it to apply)
FULL_ATTENTION_FIELDS = {
    "head_dim": ("global_head_dim", None),
    "num_key_value_heads": ("num_global_key_value_heads", "attention_k_eq_v"),
}


def layer_sizes(config: Any) -> list[tuple[int, int, int, int]] | None:
    """``(query heads, head size, key/value heads, MLP width a token runs)`` of each decoder layer,
    from a homogeneous or heterogeneous config (:func:`~grpo_parts.compat.config_values`); None
    when the config lacks the sizes."""
    hidden = _ints(config, "hidden_size", 1)[0]
    n = _ints(config, "num_hidden_layers", 1)[0] or 1
    if hidden is None:
        return None
    types = config_values(config, "layer_types")[0]
    types = list(types) if isinstance(types, (list, tuple)) and len(types) == n else [None] * n
    cols = {k: _ints(config, k, n) for k in ("num_attention_heads", "head_dim", "num_key_value_heads")}
    for field, (alias, gate) in FULL_ATTENTION_FIELDS.items():
        if gate is not None and not any(config_values(config, gate)):
            continue
        alt = _ints(config, alias, n)
        cols[field] = [a if t == "full_attention" and a else v for t, a, v in zip(types, alt, cols[field])]
    ffn = [
        m or i or 4 * hidden
        for m, i in zip(_ints(config, "moe_intermediate_size", n), _ints(config, "intermediate_size", n))
    ]
    per_tok = [k or 1 for k in _ints(config, "num_experts_per_tok", n)]
    out = []
    for h, d, kv, f, k in zip(
        cols["num_attention_heads"], cols["head_dim"], cols["num_key_value_heads"], ffn, per_tok
    ):
        if h is None:
            return None
        out.append((h, d or hidden // h, kv or h, f * k))
    return out


def score_weight(config: Any) -> float:
    """Token-equivalents of one attention score (per head and layer): a score costs ``4 H d``
    FLOPs (``q.k`` and ``p.v``, ``H`` query heads of size ``d``), a token ``2x`` a decoder layer's
    weights (attention projections + a gated MLP; MoE: the experts a token runs), summed over the
    layers (which may differ: :func:`layer_sizes`). 0 (tokens only) when the config lacks the sizes."""
    sizes = layer_sizes(config)
    hidden = _ints(config, "hidden_size", 1)[0]
    if not sizes or hidden is None:
        return 0.0
    scores = sum(4.0 * h * d for h, d, _, _ in sizes)
    weights = sum(hidden * d * (2 * h + 2 * kv) + 3 * hidden * f for h, d, kv, f in sizes)
    return scores / (2.0 * weights) if weights else 0.0


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
    grid: GroupFacts,
    chunks: list[torch.Tensor],
    grid_slots: float,
    free: GroupFacts,
    config: Any,
    build: LayoutSettings,
) -> tuple[LayoutCost, LayoutCost, float]:
    """``(grid, padding-free, weight)`` for :func:`choose_layout`, from the :class:`.facts.GroupFacts`
    each layout would share prefixes over (``grid``'s may be sub-groups of ``free``'s) and the
    layouts' settings ``build``: the padding-free attention is dense with
    ``varlen=False`` (masked eager or SDPA); ``eager`` computes whole squares."""
    kernel = build.kernel
    dense, eager = kernel in ("eager", "sdpa") and not build.varlen, kernel == "eager"
    grid_c = grid_cost(grid, chunks, grid_slots, eager)
    return grid_c, padding_free_cost(free, dense, eager), score_weight(config)
