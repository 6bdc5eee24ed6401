"""Padding-free shared-prefix layout: every group's prefix once, then its completions back to back.

One row ``[ prefix_1 | s_11 | s_12 | ... | prefix_2 | s_21 | ... ]`` (+ at most one padding column
carrying the reference's largest position id); nothing attends across a group's span. Logits are
kept where they predict a completion token. The kernels per ``PaddingFreeLayout.kernel`` (varlen
cascade, varlen eager, masked fallbacks counted in ``calls``, flex) and :data:`LAYOUTS`:
docs/attention.md, "The padding-free layout".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..protocol import LogprobBatch
from .layout import GroupedInputs, LayoutSettings, Receipts, Rows, checked_rows

#: the layouts by name, in the order ``layout="auto"`` prefers them on a tie (:mod:`.layout_choice`)
LAYOUTS: tuple[str, ...] = ("grid", "padding_free")


class _Masks:
    """Per-call cache of the kernel's masks and varlen plan (built on the first layer, reused by the
    others); ``calls``: attention calls per path, ``why``: why ``masked_sdpa`` ran. Not a dict or
    dataclass, so FSDP2's input casting passes it through like :class:`~.layout.Receipts`."""

    def __init__(self) -> None:
        self.spans: list[torch.Tensor] | None = None
        self.block: Any = None
        self.plan: Any = None
        self.calls: Counter[str] = Counter()
        self.why: list[str] = []


@dataclass(frozen=True)
class PaddingFreeLayout:
    """One row of ``row_len`` tokens. ``spans``: ``(start, end)`` of each group (and of the padding
    column); ``suffix_id: [row_len]``: 0 on prefix tokens, a distinct positive id per suffix, -1 on
    padding. ``max_span``: the longest real sequence (prompt + completion). ``varlen``: the ``sdpa``
    and ``eager`` kernels run the varlen plan (False: a dense mask per span)."""

    row_len: int
    spans: tuple[tuple[int, int], ...]
    suffix_id: torch.Tensor
    max_span: int
    kernel: str = "sdpa"
    varlen: bool = True
    receipts: Receipts = field(default_factory=Receipts, compare=False, repr=False)
    masks: _Masks = field(default_factory=_Masks, compare=False, repr=False)


def _span_offsets(r: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gtot, gstart, row_off)``: each group's span length (prefix + its completions) and start
    in the row, and where each batch row's completion starts (after its group's prefix and the
    completions before it in group order)."""
    plen, clen, order, grp = r.plen_row[r.rep], r.clen, r.order, r.row_group[r.order]
    gtot = plen + torch.zeros_like(plen).index_add(0, r.row_group, clen)
    gstart = gtot.cumsum(0) - gtot
    cs = clen[order].cumsum(0) - clen[order]  # exclusive cumsum of completions in group order
    row_off = torch.empty_like(clen)
    row_off[order] = gstart[grp] + plen[grp] + cs - cs[r.starts][grp]
    return gtot, gstart, row_off


def _fill_row(
    batch: LogprobBatch,
    r: Rows,
    gstart: torch.Tensor,
    ccol: torch.Tensor,
    length: int,
    pad: int,
    max_position: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, pos, suffix_id)`` of the row: each group's prefix (the real, left-padded prompt
    tokens of its first row) at ``gstart``, each completion at its columns ``ccol: [N, T]``;
    anything else is the padding column (``max_position``, suffix id -1)."""
    dev = batch.prompt_ids.device
    cm, pvalid = r.cm, r.pm[r.rep]
    n, t = cm.shape
    ids = torch.full((length,), pad, dtype=batch.prompt_ids.dtype, device=dev)
    pos = torch.full((length,), max_position, dtype=torch.long, device=dev)
    sid = torch.full((length,), -1, dtype=torch.long, device=dev)
    ppos = pvalid.long().cumsum(-1) - 1
    pcol = gstart.unsqueeze(-1) + ppos  # [B, Pp]
    ids[pcol[pvalid]] = batch.prompt_ids[r.rep][pvalid]
    pos[pcol[pvalid]] = ppos[pvalid]
    sid[pcol[pvalid]] = 0
    ids[ccol[cm]] = batch.completion_ids[cm]
    pos[ccol[cm]] = (r.plen_row.unsqueeze(-1) + torch.arange(t, device=dev)).expand(n, t)[cm]
    sid[ccol[cm]] = (torch.arange(n, device=dev) + 1).unsqueeze(-1).expand(n, t)[cm]
    return ids, pos, sid


def build_padding_free_inputs(
    batch: LogprobBatch, settings: LayoutSettings | None = None, max_position: int | None = None
) -> GroupedInputs:
    """``batch`` (rows in any order) in the padding-free layout, with the same index maps as
    :func:`.layout.build_grouped_inputs` (so :func:`.run.ungroup_logits` un-groups it)."""
    settings = settings or LayoutSettings()
    r = checked_rows(batch, settings.max_positions)
    dev = batch.prompt_ids.device
    n, b = batch.prompt_ids.shape[0], int(r.rep.numel())
    plen = r.plen_row[r.rep]
    gtot, gstart, row_off = _span_offsets(r)
    top = int((r.plen_row + r.clen).max()) - 1
    max_position = top if max_position is None else max_position
    real_len = int(gtot.sum())
    length = real_len + int(top < max_position)  # one padding column carries max_position
    ccol = row_off.unsqueeze(-1) + torch.arange(r.cm.shape[1], device=dev)  # [N, T]
    ids, pos, sid = _fill_row(batch, r, gstart, ccol, length, settings.pad_token_id, max_position)

    # logits: each group's last prefix token, then completion tokens 0..len-2 of every row
    s = int(r.clen.max())
    need = r.cm[:, 1:s]  # token t+1 exists: column row_off + t predicts it
    keep = torch.cat([gstart + plen - 1, ccol[:, : s - 1][need]])
    row_keep = torch.zeros(n, s, dtype=torch.long, device=dev)
    row_keep[:, 0] = r.row_group
    row_keep[:, 1:][need] = b + torch.arange(int(need.sum()), device=dev)

    bounds = torch.cat([gstart, gstart[-1:] + gtot[-1:]]).tolist()
    spans = [(int(a), int(e)) for a, e in zip(bounds[:-1], bounds[1:])]
    if length > real_len:
        spans.append((real_len, length))
    layout = PaddingFreeLayout(length, tuple(spans), sid, top + 1, settings.kernel, settings.varlen)
    return GroupedInputs(ids[None], pos[None], layout, keep, torch.zeros_like(r.row_group), row_keep, r.clen)


def _span_masks(lay: PaddingFreeLayout) -> list[torch.Tensor]:
    """``[len, len]`` boolean mask of each span (True = attend): causal, and a key is a prefix token
    or in the query's own suffix (a padding column attends to itself)."""
    if lay.masks.spans is None:
        out = []
        for a, e in lay.spans:
            sid = lay.suffix_id[a:e]
            causal = torch.ones(e - a, e - a, dtype=torch.bool, device=sid.device).tril()
            out.append(causal & ((sid == 0).unsqueeze(0) | (sid.unsqueeze(0) == sid.unsqueeze(1))))
        lay.masks.spans = out
    return lay.masks.spans


def _plan(lay: PaddingFreeLayout) -> Any:
    """The row's :class:`.varlen.VarlenPlan`, built on the first layer and reused by the others."""
    from .varlen import varlen_plan

    if lay.masks.plan is None:
        lay.masks.plan = varlen_plan(lay.spans, lay.suffix_id)
    return lay.masks.plan


def varlen_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PaddingFreeLayout) -> list[str]:
    """Why the ``sdpa`` kernel cannot run the varlen cascade here (empty = it can)."""
    from .cascade import flash_ops

    out = [] if lay.varlen else ["varlen=False (requested)"]
    if flash_ops() is None:
        out.append(f"torch {torch.__version__} lacks aten._scaled_dot_product_flash_attention_for_cpu")
    if q.device.type != "cpu":
        out.append(f"the CPU flash ops cannot run on {q.device.type}")
    if q.dtype not in (torch.float32, torch.float64, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        out.append(
            f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: the CPU flash ops take one of float32/64, bf16"
        )
    return out


def padding_free_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lay: PaddingFreeLayout,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``q: [1, H, L, D]``, ``k, v: [1, Hkv, L, D(v)]`` (KV heads not repeated) -> ``[1, H, L, Dv]``.
    Counts the path it ran in ``lay.masks.calls``."""
    from .cascade import repeat_kv
    from .varlen_eager import masked_softmax_out

    if lay.kernel == "flex":
        lay.masks.calls["flex"] += 1
        return _flex(q, k, v, lay, scale, softcap)
    if lay.kernel == "sdpa":
        why = varlen_reasons(q, k, v, lay)
        if not why:
            from .varlen import varlen_cascade

            lay.masks.calls["varlen_cascade"] += 1
            return varlen_cascade(q, k, v, _plan(lay), scale)
        lay.masks.calls["masked_sdpa"] += 1
        if not lay.masks.why:
            lay.masks.why = why
    elif lay.varlen:  # eager: plain PyTorch ops, any device and dtype
        from .varlen_eager import varlen_eager

        lay.masks.calls["varlen_eager"] += 1
        return varlen_eager(q, k, v, _plan(lay), scale, softcap, sinks)
    else:
        lay.masks.calls["masked_eager"] += 1
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    outs = []
    for (a, e), mask in zip(lay.spans, _span_masks(lay)):
        qs, ks, vs = q[:, :, a:e], k[:, :, a:e], v[:, :, a:e]
        if lay.kernel == "sdpa":
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            )
            continue
        x = (qs @ ks.transpose(-1, -2)) * scale
        sink = None if sinks is None else sinks.to(x.dtype).view(1, -1, 1, 1)
        outs.append(masked_softmax_out(x, mask, vs, softcap, sink))
    return torch.cat(outs, dim=2)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lay: PaddingFreeLayout,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if lay.masks.block is None:
        sid = lay.suffix_id
        span = torch.empty_like(sid)
        for i, (a, e) in enumerate(lay.spans):
            span[a:e] = i

        def mask_mod(bi, hi, qi, ki):  # type: ignore[no-untyped-def]
            return (span[ki] == span[qi]) & (ki <= qi) & ((sid[ki] == 0) | (sid[ki] == sid[qi]))

        lay.masks.block = create_block_mask(mask_mod, 1, None, lay.row_len, lay.row_len, device=q.device)

    def score_mod(score, bi, hi, qi, ki):  # type: ignore[no-untyped-def]
        return torch.tanh(score / softcap) * softcap

    mod = None if softcap is None else score_mod
    return flex_attention(q, k, v, block_mask=lay.masks.block, scale=scale, score_mod=mod, enable_gqa=True)  # type: ignore[no-any-return]
