"""Shared-prefix attention kernels for the grid layout of :mod:`.layout`.

Every kernel computes, for each group row ``[prefix | s_1 | ... | s_G]``:

* prefix queries attend causally to the prefix;
* suffix ``i`` queries attend to the whole (real) prefix and causally to suffix ``i`` only.

None copies the prefix K/V per suffix. ``eager`` and ``sdpa`` are *cascade* kernels: they attend to
the prefix (all G*S suffix queries of a group against the group's prefix K/V in one matmul) and to
the own suffix (a batched causal attention over ``[B*G, S]``) separately, then merge the two
partial softmaxes with their log-sum-exp. ``flex`` expresses the same pattern as a block-sparse
mask (FlexAttention reads each prefix K/V block once per query block). The ``sdpa`` kernel's
autograd Function lives in :mod:`.cascade`.

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
from .cascade import flash_ops, repeat_kv, sdpa_cascade
from .layout import LAYOUT_KWARG, PrefixLayout

KERNELS: tuple[str, ...] = ("sdpa", "eager", "flex")


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
        if flash_ops() is None:
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
        return sdpa_cascade(query, key, value, lay, scale).transpose(1, 2).contiguous(), None
    k, v = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    if lay.kernel == "eager":
        out_p, out_s = _eager(query, k, v, lay, scale, softcap)
    else:  # pragma: no cover - kernel_reasons refuses unknown kernels
        raise GRPOPartsError(f"kernel: unknown {lay.kernel!r}")
    b, h, _, d = query.shape
    out = torch.cat([out_p, out_s.reshape(b, h, -1, d)], dim=2)
    return out.transpose(1, 2).contiguous(), None
