"""Shared-prefix attention kernels for the grid layout of :mod:`.layout`.

Every kernel computes, for each group row ``[prefix | s_1 | ... | s_G]``:

* prefix queries attend causally to the prefix;
* suffix ``i`` queries attend to the whole (real) prefix and causally to suffix ``i`` only.

None copies the prefix K/V per suffix. ``eager`` and ``sdpa`` are *cascade* kernels: they attend to
the prefix (all G*S suffix queries of a group against the group's prefix K/V in one matmul) and to
the own suffix (a batched causal attention over ``[B*G, S]``) separately, then merge the two
partial softmaxes with their log-sum-exp. ``flex`` expresses the same pattern as a block-sparse
mask (FlexAttention reads each prefix K/V block once per query block).

=========  ==========================================  ===========================================
kernel     how                                         supports
=========  ==========================================  ===========================================
eager      matmul + logsumexp merge, plain autograd    everything incl. logit soft-capping; any
                                                       device/dtype; materialises scores
sdpa       PyTorch's CPU flash-attention ops, merged   CPU, float32/float64/bfloat16; no
           in a custom autograd Function whose         soft-capping; O(L) memory per head
           backward reuses the merged output + LSE
flex       FlexAttention ``mask_mod`` (+ ``score_mod``  soft-capping; on CPU forward only
           for soft-capping)                           (torch has no CPU flex backward)
=========  ==========================================  ===========================================
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from ..compat import sdpa_attention_forward
from ..errors import GRPOPartsError, NotSupportedError
from .layout import LAYOUT_KWARG, PrefixLayout

KERNELS: tuple[str, ...] = ("sdpa", "eager", "flex")


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, l_, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, l_, d).reshape(b, h * n_rep, l_, d)


def _split(x: torch.Tensor, lay: PrefixLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, L, D]`` -> prefix ``[B, H, Pp, D]``, suffixes ``[B, H, G, S, D]``."""
    b, h, _, d = x.shape
    p = lay.prefix_len
    return x[:, :, :p], x[:, :, p:].reshape(b, h, lay.num_slots, lay.slot_len, d)


# ----------------------------------------------------------------------------------------- eager


def _eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PrefixLayout, scale: float, softcap: float | None
):
    b, h, _, d = q.shape
    p, g, s = lay.prefix_len, lay.num_slots, lay.slot_len
    neg = torch.finfo(q.dtype).min

    def scores(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        x = (a @ bt.transpose(-1, -2)) * scale
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    qp, qs = _split(q, lay)
    kp, ks = _split(k, lay)
    vp, vs = _split(v, lay)
    causal_p = torch.ones(p, p, dtype=torch.bool, device=q.device).tril()
    out_p = torch.softmax(scores(qp, kp).masked_fill(~causal_p, neg), dim=-1) @ vp
    # suffix -> prefix: all G*S queries of a group against the group's prefix keys, read once.
    s1 = scores(qs.reshape(b, h, g * s, d), kp).view(b, h, g, s, p)
    if lay.prefix_valid is not None:
        s1 = s1.masked_fill(~lay.prefix_valid[:, None, None, None, :], neg)
    causal_s = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    s2 = scores(qs, ks).masked_fill(~causal_s, neg)  # suffix -> own suffix, [B, H, G, S, S]
    lse = torch.logaddexp(s1.logsumexp(-1), s2.logsumexp(-1)).unsqueeze(-1)
    out_s = ((s1 - lse).exp().view(b, h, g * s, p) @ vp).view(b, h, g, s, d) + (s2 - lse).exp() @ vs
    return out_p, out_s


# ------------------------------------------------------------------------------------------ sdpa


def _flash_ops() -> tuple[Any, Any] | None:
    aten = torch.ops.aten
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    ):
        return (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    return None


def _slot_chunks(g: int, rows_per_slot: int, elems_per_row: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Row ranges of the slot-major flat layout, whole slots per chunk, about ``chunk_elems`` scores each."""
    step = max(1, chunk_elems // max(1, rows_per_slot * elems_per_row))
    return [(i * rows_per_slot, min(g, i + step) * rows_per_slot) for i in range(0, g, step)]


def _flat_slots(x: torch.Tensor, p: int, g: int, s: int, rep: int) -> torch.Tensor:
    """``[B, Hkv*rep, L, D]`` suffix part -> ``[G*B*Hkv, rep*S, D]`` (slot-major, contiguous copy):
    the grouped-query heads of one KV head become extra query rows of one small matmul."""
    b, h, _, d = x.shape
    y = x[:, :, p:].reshape(b, h // rep, rep, g, s, d).permute(3, 0, 1, 2, 4, 5)
    return y.reshape(g * b * (h // rep), rep * s, d).contiguous()


def _unflat_slots(y: torch.Tensor, b: int, hk: int, rep: int, g: int, s: int) -> torch.Tensor:
    """Inverse view of :func:`_flat_slots`: ``[B, Hkv, rep, G, S, ...]`` (no copy)."""
    return y.view(g, b, hk, rep, s, *y.shape[2:]).permute(1, 2, 3, 0, 4, *range(5, y.ndim + 3))


def _slots4(
    kf: torch.Tensor, vf: torch.Tensor, n: int, hk: int, rep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``[G*B*Hkv, S, D]`` suffix K/V -> ``[G*B, H, S, D]`` with KV heads repeated for flash."""
    s, d = kf.shape[1], kf.shape[2]
    return _repeat_kv(kf.view(n, hk, s, d), rep), _repeat_kv(vf.view(n, hk, s, d), rep)


class _Cascade(torch.autograd.Function):
    """Shared-prefix attention as two parts merged by log-sum-exp:

    (a) every query of the row against the prefix keys: one CPU flash call with ``is_causal``
        (top-left aligned, so a prefix query sees the prefix causally and a suffix query all of it);
    (b) each suffix against itself, causal: one batched matmul per chunk of slots,
        ``[G*B*Hkv, rep*S, S]`` (grouped-query heads folded into query rows, not repeated), or for
        long suffixes (``S >= suffix_flash_min``) one flash call over ``[G*B, H, S, D]``.

    The flash op returns the LSE but not its gradient; backward is still exact because the flash
    backward of (a), given the *merged* output and LSE, yields (a)'s share of the joint softmax's
    gradient (it recomputes ``P = exp(S - LSE)`` and ``D = rowsum(dO * O)``); (b)'s backward is
    written out the same way. Inputs are the full ``q: [B, H, L, D]``, ``k, v: [B, Hkv, L, D]``
    so that no slicing/repeat backward allocates zero-filled full-size gradients."""

    @staticmethod
    def forward(ctx, q, k, v, bias, p, g, s, scale, chunk, flash_b):  # type: ignore[override]
        fwd, _ = _flash_ops()  # type: ignore[misc]
        b, h, length, d = q.shape
        hk = k.shape[1]
        rep = h // hk
        ctx.chunk, ctx.flash_b = chunk, flash_b
        kp, vp = _repeat_kv(k[:, :, :p], rep), _repeat_kv(v[:, :, :p], rep)
        out, lse = fwd(q, kp, vp, 0.0, True, attn_mask=bias, scale=scale)
        qf = _flat_slots(q, p, g, s, rep)
        kf, vf = _flat_slots(k, p, g, s, 1), _flat_slots(v, p, g, s, 1)
        if ctx.flash_b:  # long suffixes: flash (skips the causal upper triangle), heads repeated per slot
            ob4, lb4 = fwd(
                qf.reshape(g * b, h, s, d), *_slots4(kf, vf, g * b, hk, rep), 0.0, True, scale=scale
            )
            ob, lb = ob4.reshape(qf.shape), lb4.reshape(qf.shape[:2])
        else:
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().repeat(rep, 1)
            lb = q.new_empty(qf.shape[:2])
            ob = torch.empty_like(qf)
            for i, j in _slot_chunks(g, b * hk, rep * s * s, ctx.chunk):
                sc = (
                    torch.bmm(qf[i:j], kf[i:j].transpose(1, 2))
                    .mul_(scale)
                    .masked_fill_(~causal, float("-inf"))
                )
                torch.logsumexp(sc, -1, out=lb[i:j])
                torch.bmm(sc.sub_(lb[i:j].unsqueeze(-1)).exp_(), vf[i:j], out=ob[i:j])
        la = lse[:, :, p:].view(b, hk, rep, g, s)
        lbv = _unflat_slots(lb, b, hk, rep, g, s)
        ls = torch.logaddexp(la, lbv)
        out_s = out[:, :, p:].view(b, hk, rep, g, s, d)
        out_s.mul_((la - ls).exp_().unsqueeze(-1)).add_(
            _unflat_slots(ob, b, hk, rep, g, s) * (lbv - ls).exp_().unsqueeze(-1)
        )
        la.copy_(ls)
        ctx.save_for_backward(
            q, k, v, kp, vp, bias if bias is not None else torch.empty(0), out, lse, qf, kf, vf
        )
        ctx.has_bias, ctx.scale, ctx.dims = bias is not None, scale, (p, g, s)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        _, bwd = _flash_ops()  # type: ignore[misc]
        q, k, v, kp, vp, bias, out, lse, qf, kf, vf = ctx.saved_tensors
        p, g, s = ctx.dims
        b, h, length, d = q.shape
        hk = k.shape[1]
        rep, scale = h // hk, ctx.scale
        dout = dout.contiguous()
        dq, dkp, dvp = bwd(
            dout, q, kp, vp, out, lse, 0.0, True, attn_mask=bias if ctx.has_bias else None, scale=scale
        )
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        dk[:, :, :p] = dkp.view(b, hk, rep, p, d).sum(2)
        dv[:, :, :p] = dvp.view(b, hk, rep, p, d).sum(2)
        dof = _flat_slots(dout, p, g, s, rep)
        delta = (dout * out).sum(-1, keepdim=True)  # [B, H, L, 1] (prefix rows unused)
        lsf = _flat_slots(lse.unsqueeze(-1), p, g, s, rep)  # merged LSE, [G*B*Hkv, rep*S, 1]
        deltaf = _flat_slots(delta, p, g, s, rep)
        if ctx.flash_b:
            k4, v4 = _slots4(kf, vf, g * b, hk, rep)
            outf = _flat_slots(out, p, g, s, rep)
            dq4, dk4, dv4 = bwd(
                dof.reshape(g * b, h, s, d),
                qf.reshape(g * b, h, s, d),
                k4,
                v4,
                outf.reshape(g * b, h, s, d),
                lsf.reshape(g * b, h, s),
                0.0,
                True,
                scale=scale,
            )
            dqf = dq4.reshape(qf.shape)
            dkf = dk4.reshape(g * b, hk, rep, s, d).sum(2).reshape(kf.shape)
            dvf = dv4.reshape(g * b, hk, rep, s, d).sum(2).reshape(vf.shape)
            chunks: list[tuple[int, int]] = []
        else:
            dqf = torch.empty_like(qf)
            dkf = torch.empty_like(kf)
            dvf = torch.empty_like(vf)
            chunks = _slot_chunks(g, b * hk, rep * s * s, ctx.chunk)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().repeat(rep, 1)
        for i, j in chunks:
            sc = torch.bmm(qf[i:j], kf[i:j].transpose(1, 2)).mul_(scale).masked_fill_(~causal, float("-inf"))
            pr = sc.sub_(lsf[i:j]).exp_()  # this part's share of the joint softmax
            torch.bmm(pr.transpose(1, 2), dof[i:j], out=dvf[i:j])
            ds = torch.bmm(dof[i:j], vf[i:j].transpose(1, 2)).sub_(deltaf[i:j]).mul_(pr).mul_(scale)
            torch.bmm(ds, kf[i:j], out=dqf[i:j])
            torch.bmm(ds.transpose(1, 2), qf[i:j], out=dkf[i:j])
        dq[:, :, p:].view(b, hk, rep, g, s, d).add_(_unflat_slots(dqf, b, hk, rep, g, s))
        dk[:, :, p:].view(b, hk, g, s, d).copy_(_unflat_slots(dkf, b, hk, 1, g, s).squeeze(2))
        dv[:, :, p:].view(b, hk, g, s, d).copy_(_unflat_slots(dvf, b, hk, 1, g, s).squeeze(2))
        return dq, dk, dv, None, None, None, None, None, None, None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PrefixLayout, scale: float) -> torch.Tensor:
    """``q: [B, H, L, D]``, ``k, v: [B, Hkv, L, D]`` (not repeated) -> ``[B, H, L, D]``."""
    bias = None
    if lay.prefix_valid is not None:
        bias = torch.zeros(lay.prefix_valid.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~lay.prefix_valid, float("-inf"))[:, None, None, :]
    flash_b = lay.slot_len >= lay.suffix_flash_min
    return _Cascade.apply(
        q, k, v, bias, lay.prefix_len, lay.num_slots, lay.slot_len, scale, lay.chunk_elems, flash_b
    )


# ------------------------------------------------------------------------------------------ flex


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PrefixLayout, scale: float, softcap: float | None
):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, l_, _ = q.shape
    p, s = lay.prefix_len, lay.slot_len
    idx = torch.arange(l_, device=q.device)
    seg = torch.where(idx < p, 0, (idx - p) // s + 1)  # 0 = prefix, i+1 = slot i
    valid = (
        lay.prefix_valid
        if lay.prefix_valid is not None
        else torch.ones(b, p, dtype=torch.bool, device=q.device)
    )
    valid_k = torch.cat([valid, torch.ones(b, l_ - p, dtype=torch.bool, device=q.device)], dim=1)

    def mask_mod(bi, hi, qi, ki):  # type: ignore[no-untyped-def]
        own = (seg[ki] == seg[qi]) & (ki <= qi)
        return own | ((seg[ki] == 0) & (seg[qi] > 0) & valid_k[bi, ki])

    def score_mod(score, bi, hi, qi, ki):  # type: ignore[no-untyped-def]
        return torch.tanh(score / softcap) * softcap

    block = create_block_mask(mask_mod, b, None, l_, l_, device=q.device)
    out = flex_attention(
        q,
        k,
        v,
        block_mask=block,
        scale=scale,
        score_mod=None if softcap is None else score_mod,
        enable_gqa=True,
    )
    return out  # [B, H, L, D]


# ------------------------------------------------------------------------------ the attention fn


def kernel_reasons(
    kernel: str, *, device: torch.device, dtype: torch.dtype, softcap: bool, grad: bool
) -> list[str]:
    """Why ``kernel`` cannot run with these properties (empty = it can)."""
    if kernel == "eager":
        return []
    if kernel == "sdpa":
        out = []
        if device.type != "cpu":
            out.append(f"sdpa cascade kernel uses PyTorch's CPU flash ops; got device {device.type}")
        if _flash_ops() is None:
            out.append(
                f"torch {torch.__version__} lacks aten._scaled_dot_product_flash_attention_for_cpu(_backward)"
            )
        if softcap:
            out.append("attention logit soft-capping is not supported by flash/SDPA (use 'eager' or 'flex')")
        if dtype not in (torch.float32, torch.float64, torch.bfloat16):
            out.append(f"dtype {dtype} not supported by the CPU flash ops")
        return out
    if kernel == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError as e:
            return [f"FlexAttention unavailable: {e}"]
        if device.type == "cpu" and grad:
            return [
                f"torch {torch.__version__} FlexAttention has no backward on CPU (usable for no-grad forwards)"
            ]
        return []
    if kernel == "flash_varlen":
        return [
            "flash-attn varlen kernel not implemented: flash_attn's varlen API returns an LSE without "
            "gradient and its private backward changes between releases; use 'flex' on CUDA instead"
        ]
    return [f"unknown kernel {kernel!r}; expected one of {KERNELS}"]


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function. With a :class:`PrefixLayout` in
    ``kwargs[LAYOUT_KWARG]`` it computes shared-prefix attention; without one (generation, an
    ordinary forward) it is transformers' SDPA attention."""
    lay: PrefixLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if lay is None:
        if softcap is not None:
            raise NotSupportedError("shared_prefix fallback (sdpa)", ["attention logit soft-capping"])
        return sdpa_attention_forward()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )  # type: ignore[return-value]
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        # as transformers' SDPA under autocast (e.g. TRL's bf16=True on a float32 model, where RoPE
        # leaves q/k in float32 and v in bf16): all three in the autocast dtype
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    reasons = []
    if dropout > 0.0:
        reasons.append(
            f"attention dropout {dropout} in training mode (randomness differs from the reference)"
        )
    if sliding_window is not None and lay.max_span > sliding_window:
        reasons.append(
            f"sliding window {sliding_window} shorter than the longest sequence ({lay.max_span} tokens) "
            f"in layer {getattr(module, 'layer_idx', '?')}"
        )
    if query.shape[2] != lay.row_len:
        reasons.append(f"query length {query.shape[2]} != layout row length {lay.row_len} (KV cache in use?)")
    reasons += kernel_reasons(
        lay.kernel,
        device=query.device,
        dtype=query.dtype,
        softcap=softcap is not None,
        grad=torch.is_grad_enabled(),
    )
    if reasons:
        raise NotSupportedError(f"shared_prefix[{lay.kernel}]", reasons)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    n_rep = query.shape[1] // key.shape[1]
    if lay.kernel == "flex":
        out = _flex(query, key, value, lay, scale, softcap)
        return out.transpose(1, 2).contiguous(), None
    if lay.kernel == "sdpa":
        return _sdpa(query, key, value, lay, scale).transpose(1, 2).contiguous(), None
    k, v = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    if lay.kernel == "eager":
        out_p, out_s = _eager(query, k, v, lay, scale, softcap)
    else:  # pragma: no cover - kernel_reasons refuses unknown kernels
        raise GRPOPartsError(f"kernel: unknown {lay.kernel!r}")
    b, h, _, d = query.shape
    out = torch.cat([out_p, out_s.reshape(b, h, -1, d)], dim=2)
    return out.transpose(1, 2).contiguous(), None
