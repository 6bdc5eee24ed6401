"""The padding-free layout's ``eager`` kernel: the varlen plan (:mod:`.varlen`) in plain PyTorch ops.

For soft-capping (Gemma-2), attention sinks (gpt-oss), or by choice. Per length bucket, each
completion's queries see its span's prefix keys *and* its own keys in ONE softmax, so soft-capping
and sinks are exactly the reference's. Buckets may mix spans (each gathers its own prefix keys with
a key mask); grouped-query heads are folded, never repeated; autograd does the backward.
docs/attention.md, "The padding-free layout".
"""

from __future__ import annotations

import torch

from .varlen import VarlenPlan


def masked_softmax_out(
    x: torch.Tensor, keep: torch.Tensor, v: torch.Tensor, softcap: float | None, sink: torch.Tensor | None
) -> torch.Tensor:
    """``softmax(cap(x) masked by keep, + sink) @ v``: the eager softmax of both padding-free eager paths
    (soft-capping before the mask; a sink is one extra logit per head in the normaliser, no value)."""
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    x = x.masked_fill(~keep, torch.finfo(x.dtype).min)
    lse = x.logsumexp(-1, keepdim=True)
    if sink is not None:  # one extra logit per head in every softmax, no value
        lse = torch.logaddexp(lse, sink)
    return (x - lse).exp() @ v


def _fold(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[n, H, S, D]`` -> ``[n, Hkv, rep, S, D]`` (query head ``h`` reads KV head ``h // rep``)."""
    return x.view(x.shape[0], hk, x.shape[1] // hk, *x.shape[2:])


def varlen_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: VarlenPlan,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``q: [1, H, L, D]``, ``k: [1, Hkv, L, D]``, ``v: [1, Hkv, L, Dv]`` -> ``[1, H, L, Dv]``."""
    h, hk, dev = q.shape[1], k.shape[1], q.device
    sink = None if sinks is None else sinks.to(q.dtype).view(1, hk, h // hk, 1, 1)
    q5, k5, v5 = _fold(q, hk), k.unsqueeze(2), v.unsqueeze(2)  # [1, Hkv, rep|1, L, D]
    outs, where = [], []
    # (a) prefix queries vs the prefix, per span (a padding column's "prefix" is itself)
    for a, _, p in plan.spans:
        x = (q5[..., a : a + p, :] @ k5[..., a : a + p, :].transpose(-1, -2)) * scale
        causal = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
        outs.append(masked_softmax_out(x, causal, v5[..., a : a + p, :], softcap, sink).flatten(1, 2)[0])
        where.append(torch.arange(a, a + p, device=dev))
    # (b) each bucket's completions vs [their span's prefix | themselves], one softmax
    start = torch.tensor([a for a, _, _ in plan.spans], device=dev)
    plen = torch.tensor([p for _, _, p in plan.spans], device=dev)
    ends = torch.tensor([e for _, e, _ in plan.spans], device=dev)
    for idx, valid in plan.buckets:
        n, s = idx.shape
        # the span each completion lies in, its prefix (end-padded to the bucket's longest) and keys
        span = torch.searchsorted(ends, idx[:, 0].contiguous(), right=True)
        pl = plen[span]
        pm = int(pl.max())
        ar = torch.arange(pm, device=dev)
        pidx = start[span].unsqueeze(-1) + torch.minimum(ar, pl.unsqueeze(-1) - 1)  # [n, Pm]
        kidx = torch.cat([pidx, idx], 1)  # [n, Pm + S]
        own = torch.ones(s, s, dtype=torch.bool, device=dev).tril().expand(n, s, s)
        keep = torch.cat([(ar < pl.unsqueeze(-1)).unsqueeze(1).expand(n, s, pm), own], -1)[:, None, None]
        qb = q5[0][:, :, idx].permute(2, 0, 1, 3, 4)  # [n, Hkv, rep, S, D]
        kb = k5[0][:, :, kidx].permute(2, 0, 1, 3, 4)  # [n, Hkv, 1, Pm + S, D]
        vb = v5[0][:, :, kidx].permute(2, 0, 1, 3, 4)
        ob = masked_softmax_out((qb @ kb.transpose(-1, -2)) * scale, keep, vb, softcap, sink)
        outs.append(ob.flatten(1, 2).transpose(0, 1)[:, valid])  # [H, real tokens, Dv]
        where.append(idx[valid])
    out = torch.cat(outs, 1)
    return out[:, torch.argsort(torch.cat(where))].unsqueeze(0)  # every row position exactly once


def eager_scores(plan: VarlenPlan) -> int:
    """Scores :func:`varlen_eager` computes per head (whole squares, bucket padding included)."""
    ends = torch.tensor([e for _, e, _ in plan.spans])
    plen = torch.tensor([p for _, _, p in plan.spans])
    out = sum(p * p for _, _, p in plan.spans)
    for idx, _ in plan.buckets:
        pm = int(plen[torch.searchsorted(ends, idx[:, 0].cpu().contiguous(), right=True)].max())
        out += idx.shape[0] * idx.shape[1] * (pm + idx.shape[1])
    return out
