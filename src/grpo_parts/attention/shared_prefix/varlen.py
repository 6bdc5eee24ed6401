"""The padding-free layout's ``sdpa`` kernel: a *varlen cascade* of PyTorch's CPU flash ops.

Per span ``[prefix (P) | s_1 | ... | s_G]``, about ``P^2/2 + sum_j S_j (P + S_j/2)`` scores instead of
``(P + sum_j S_j)^2``: (a) every query against the prefix keys, one causal flash call; (b) each
completion against itself, in length buckets end-padded to the bucket's longest (exact under the
causal mask); (c) merged by log-sum-exp. Backward reuses :class:`.cascade._Cascade`'s argument;
padded queries get a zero output gradient and their own bucket LSE (so every recomputed probability
is finite). docs/attention.md, "The padding-free layout".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cascade import flash_ops, repeat_kv, same_head_size

#: a bucket's shortest completion is at least its longest / (1 + BUCKET_SLACK)
BUCKET_SLACK = 0.25


@dataclass(frozen=True)
class VarlenPlan:
    """Where the flash calls read. ``spans``: ``(start, end, prefix_len)`` tiling the row (a padding
    column is a span whose "prefix" is itself); ``buckets``: ``(idx, valid)`` per bucket, ``idx:
    [n, S]`` row positions of each completion's tokens padded at the end with its last token,
    ``valid: [n, S]``; ``pos``: ``cat(idx[valid])`` over the buckets (every suffix token once)."""

    spans: tuple[tuple[int, int, int], ...]
    buckets: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    pos: torch.Tensor

    @property
    def scores(self) -> int:
        """Causal scores the flash calls compute per head (the cost model, padding included)."""
        a = sum((e - s) * p - p * (p - 1) // 2 for s, e, p in self.spans)
        return a + sum(i.shape[0] * i.shape[1] * (i.shape[1] + 1) // 2 for i, _ in self.buckets)


def bucket_lengths(lengths: list[int], slack: float = BUCKET_SLACK) -> list[list[int]]:
    """Indices into ``lengths`` grouped into buckets: sorted longest first, a bucket takes every next
    completion at least ``longest / (1 + slack)`` long (so end padding stays below ``slack``)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and lengths[i] * (1.0 + slack) >= lengths[out[-1][0]]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def varlen_plan(
    spans: tuple[tuple[int, int], ...], suffix_id: torch.Tensor, slack: float = BUCKET_SLACK
) -> VarlenPlan:
    """The plan of a padding-free row (``suffix_id``: 0 prefix, a distinct positive id per
    completion, -1 padding; every completion contiguous, right after its span's prefix)."""
    sid = suffix_id.tolist()
    out_spans = []
    for a, e in spans:
        p = e - a if sid[a] != 0 else next((i for i in range(a, e) if sid[i] != 0), e) - a
        out_spans.append((a, e, p))
    ids, counts = torch.unique_consecutive(suffix_id, return_counts=True)
    starts = counts.cumsum(0) - counts
    real = ids > 0
    starts, lens = starts[real], counts[real]
    buckets = []
    for members in bucket_lengths(lens.tolist(), slack):
        m = torch.tensor(members, dtype=torch.long)
        st, ln = starts[m], lens[m]
        s = int(ln.max())
        ar = torch.arange(s)
        idx = st.unsqueeze(-1) + torch.minimum(ar.unsqueeze(0), (ln - 1).unsqueeze(-1))
        buckets.append((idx.to(suffix_id.device), (ar.unsqueeze(0) < ln.unsqueeze(-1)).to(suffix_id.device)))
    pos = torch.cat([i[v] for i, v in buckets]) if buckets else suffix_id.new_empty(0)
    return VarlenPlan(tuple(out_spans), tuple(buckets), pos)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x: [1, H, L, ...]`` at row positions ``idx: [n, S]`` -> ``[n, H, S, ...]`` (a view of a copy)."""
    return x[0][:, idx].transpose(0, 1)


def _flat(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bucket tensor ``[n, H, S, ...]`` -> its real tokens ``[H, sum(valid), ...]`` in ``idx[valid]`` order."""
    return x.transpose(0, 1)[:, valid]


class _Varlen(torch.autograd.Function):
    """``q: [1, H, L, D]``, ``k, v: [1, Hkv, L, D]`` -> ``[1, H, L, D]`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):  # type: ignore[override]
        fwd, _ = flash_ops()  # type: ignore[misc]
        rep = q.shape[1] // k.shape[1]
        parts = [
            fwd(q[:, :, a:e], repeat_kv(k[:, :, a : a + p], rep), repeat_kv(v[:, :, a : a + p], rep),
                0.0, True, scale=scale)
            for a, e, p in plan.spans
        ]  # fmt: skip
        out = torch.cat([o for o, _ in parts], 2)
        lse = torch.cat([lp for _, lp in parts], 2)
        obs, lbs, own = [], [], []
        for idx, valid in plan.buckets:
            kb, vb = repeat_kv(_gather(k, idx), rep), repeat_kv(_gather(v, idx), rep)
            ob, lb = fwd(_gather(q, idx), kb, vb, 0.0, True, scale=scale)
            obs.append(_flat(ob, valid))
            lbs.append(_flat(lb, valid))
            own.append(lb)
        if obs:
            pos = plan.pos
            ob, lb = torch.cat(obs, 1), torch.cat(lbs, 1)
            la = lse[0][:, pos]
            ls = torch.logaddexp(la, lb)
            o = out[0][:, pos] * (la - ls).exp().unsqueeze(-1) + ob * (lb - ls).exp().unsqueeze(-1)
            out[0][:, pos] = o.to(out.dtype)
            lse[0][:, pos] = ls
        ctx.save_for_backward(q, k, v, out, lse, *own)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        _, bwd = flash_ops()  # type: ignore[misc]
        q, k, v, out, lse, *own = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        h, hk, d = q.shape[1], k.shape[1], q.shape[-1]
        rep = h // hk
        dout = dout.contiguous()
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for a, e, p in plan.spans:
            kp, vp = repeat_kv(k[:, :, a : a + p], rep), repeat_kv(v[:, :, a : a + p], rep)
            sl = slice(a, e)
            dqs, dkp, dvp = bwd(
                dout[:, :, sl], q[:, :, sl], kp, vp, out[:, :, sl], lse[:, :, sl], 0.0, True, scale=scale
            )
            dq[:, :, sl] = dqs
            dk[:, :, a : a + p] = dkp.view(1, hk, rep, p, d).sum(2)
            dv[:, :, a : a + p] = dvp.view(1, hk, rep, p, d).sum(2)
        for (idx, valid), lb in zip(plan.buckets, own):
            n, s = idx.shape
            vm = valid[:, None, :]
            dob = _gather(dout, idx) * vm.unsqueeze(-1)
            lsb = torch.where(vm, _gather(lse, idx), lb)
            kb, vb = repeat_kv(_gather(k, idx), rep), repeat_kv(_gather(v, idx), rep)
            dqb, dkb, dvb = bwd(dob, _gather(q, idx), kb, vb, _gather(out, idx), lsb, 0.0, True, scale=scale)
            pos = idx[valid]
            dq[0][:, pos] += _flat(dqb, valid)
            dk[0][:, pos] = _flat(dkb.view(n, hk, rep, s, d).sum(2), valid)
            dv[0][:, pos] = _flat(dvb.view(n, hk, rep, s, d).sum(2), valid)
        return dq, dk, dv, None, None


def varlen_cascade(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, scale: float
) -> torch.Tensor:
    """``q: [1, H, L, D]``, ``k: [1, Hkv, L, D]``, ``v: [1, Hkv, L, Dv]`` (KV heads not repeated)
    -> ``[1, H, L, Dv]`` (MLA's ``Dv != D`` through :func:`.cascade.same_head_size`)."""
    return same_head_size(lambda q_, k_, v_: _Varlen.apply(q_, k_, v_, plan, scale), q, k, v)
