"""Shared-prefix attention kernels for the grid layout of :mod:`.layout`.

Per group row ``[prefix | s_1 | ... | s_G]``: prefix queries attend causally to the prefix, suffix
``i`` queries to the whole real prefix and causally to suffix ``i`` only; no kernel copies the prefix
K/V per suffix. ``eager`` and ``sdpa`` (autograd Function in :mod:`.cascade`) merge the prefix and
own-suffix partial softmaxes by log-sum-exp; ``flex`` is a block-sparse mask. What each supports:
the kernel table in docs/attention.md.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from ...compat import own_attention, own_attention_function, sdpa_attention_forward
from ...errors import NotSupportedError
from .cascade import flash_ops, repeat_kv, sdpa_cascade
from .layout import LAYOUT_KWARG, PrefixLayout
from .padding_free import PaddingFreeLayout, padding_free_attention

KERNELS: tuple[str, ...] = ("sdpa", "eager", "flex")


def _split(x: torch.Tensor, lay: PrefixLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, L, D]`` -> prefix ``[B, H, Pp, D]``, suffixes ``[B, H, G, S, D]``."""
    b, h, _, d = x.shape
    p = lay.prefix_len
    return x[:, :, :p], x[:, :, p:].reshape(b, h, lay.num_slots, lay.slot_len, d)


def _eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lay: PrefixLayout,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
):
    """``sinks: [H]`` (attention sinks, gpt-oss' ``s_aux``): one extra logit per head that joins
    every query's softmax normalisation and contributes no value, as in transformers' eager."""
    b, h, _, d = q.shape
    dv = v.shape[-1]  # MLA (DeepSeek-V2/V3, MiniCPM3): value head size != query/key head size
    p, g, s = lay.prefix_len, lay.num_slots, lay.slot_len
    neg = torch.finfo(q.dtype).min
    sink = None if sinks is None else sinks.to(q.dtype).view(1, h, 1, 1)

    def scores(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        x = (a @ bt.transpose(-1, -2)) * scale
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    qp, qs = _split(q, lay)
    kp, ks = _split(k, lay)
    vp, vs = _split(v, lay)
    causal_p = torch.ones(p, p, dtype=torch.bool, device=q.device).tril()
    s0 = scores(qp, kp).masked_fill(~causal_p, neg)
    if sink is None:
        out_p = torch.softmax(s0, dim=-1) @ vp
    else:
        out_p = (s0 - torch.logaddexp(s0.logsumexp(-1), sink[..., 0]).unsqueeze(-1)).exp() @ vp
    # suffix -> prefix: all G*S queries of a group against the group's prefix keys, read once.
    s1 = scores(qs.reshape(b, h, g * s, d), kp).view(b, h, g, s, p)
    if lay.prefix_valid is not None:
        s1 = s1.masked_fill(~lay.prefix_valid[:, None, None, None, :], neg)
    causal_s = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    s2 = scores(qs, ks).masked_fill(~causal_s, neg)  # suffix -> own suffix, [B, H, G, S, S]
    lse = torch.logaddexp(s1.logsumexp(-1), s2.logsumexp(-1))
    if sink is not None:
        lse = torch.logaddexp(lse, sink)  # [B, H, G, S] with [1, H, 1, 1]
    lse = lse.unsqueeze(-1)
    out_s = ((s1 - lse).exp().view(b, h, g * s, p) @ vp).view(b, h, g, s, dv) + (s2 - lse).exp() @ vs
    return out_p, out_s


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PrefixLayout, scale: float, softcap: float | None
):  # -> [B, H, L, D]
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, l_, _ = q.shape
    p, s = lay.prefix_len, lay.slot_len
    idx = torch.arange(l_, device=q.device)
    seg = torch.where(idx < p, 0, (idx - p) // s + 1)  # 0 = prefix, i+1 = slot i
    valid_k = torch.ones(b, l_, dtype=torch.bool, device=q.device)
    if lay.prefix_valid is not None:
        valid_k[:, :p] = lay.prefix_valid

    def mask_mod(bi, hi, qi, ki):  # type: ignore[no-untyped-def]
        own = (seg[ki] == seg[qi]) & (ki <= qi)
        return own | ((seg[ki] == 0) & (seg[qi] > 0) & valid_k[bi, ki])

    def score_mod(score, bi, hi, qi, ki):  # type: ignore[no-untyped-def]
        return torch.tanh(score / softcap) * softcap

    block = create_block_mask(mask_mod, b, None, l_, l_, device=q.device)
    mod = None if softcap is None else score_mod
    return flex_attention(q, k, v, block_mask=block, scale=scale, score_mod=mod, enable_gqa=True)


#: keyword arguments transformers passes to attention functions that do not change the attention
#: here: positions (the model applied them to q/k already; the layout gives each token its own
#: position), cache and output switches, MoE router outputs
INERT_KWARGS = frozenset(
    "position_ids cache_position use_cache output_router_logits output_hidden_states return_dict".split()
)
#: accepted only when None/False: attention weights are not returned, no KV cache is read
FALSY_KWARGS = frozenset({"output_attentions", "past_key_value", "past_key_values", "cache"})


def _where(module: torch.nn.Module) -> str:
    cfg = getattr(module, "config", None)
    model = f"{getattr(cfg, 'model_type', '?')} model, " if cfg is not None else ""
    return f"{type(module).__name__} ({model}layer {getattr(module, 'layer_idx', '?')})"


def kwarg_reasons(module: torch.nn.Module, kwargs: dict[str, Any], *, fallback: bool = False) -> list[str]:
    """Keyword arguments the kernel would otherwise ignore (anything beyond its named parameters and
    :data:`INERT_KWARGS`, not None, and for :data:`FALSY_KWARGS` not false): each is a refusal. In the
    SDPA ``fallback`` (no layout) the :data:`FALSY_KWARGS` are inert too, as for transformers' SDPA."""
    inert = INERT_KWARGS | FALSY_KWARGS if fallback else INERT_KWARGS
    return [
        f"{_where(module)} passes keyword argument {name}={type(val).__name__} which the shared-prefix "
        "kernel does not implement"
        for name, val in kwargs.items()
        if val is not None and name not in inert and not (name in FALSY_KWARGS and not val)
    ]


def kernel_reasons(
    kernel: str, *, device: torch.device, dtype: torch.dtype, softcap: bool, grad: bool, sinks: bool = False
) -> list[str]:
    """Why ``kernel`` cannot run with these properties (empty = it can)."""
    if kernel == "eager":
        return []
    if kernel in ("sdpa", "flex") and sinks:
        return [f"attention sinks (s_aux) are implemented in the 'eager' kernel only, not in {kernel!r}"]
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


def _fallback_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    named: dict[str, Any],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """No layout: the model's own attention if one was selected before this kernel, else
    transformers' SDPA (refusing what SDPA would silently drop). ``named`` holds
    ``sliding_window``, ``softcap``, ``s_aux`` and ``is_causal`` as the caller got them."""
    own = own_attention(getattr(module, "config", None))
    fn = None if own is None else own_attention_function(module, own)
    if fn is not None:
        extra = {k: v for k, v in named.items() if v is not None}
        return fn(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )  # type: ignore[no-any-return]
    if own is not None:
        raise NotSupportedError(
            "shared_prefix fallback", [f"{_where(module)}: no attention function for {own!r} to fall back to"]
        )
    reasons = kwarg_reasons(module, kwargs, fallback=True)
    if named["softcap"] is not None:
        reasons.append("attention logit soft-capping (transformers' SDPA has none)")
    if named["s_aux"] is not None:
        reasons.append("attention sinks (s_aux; transformers' SDPA has none)")
    if reasons:
        raise NotSupportedError("shared_prefix fallback (sdpa)", reasons)
    is_causal = named["is_causal"]
    extra = {} if is_causal is None else {"is_causal": is_causal}
    return sdpa_attention_forward()(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
    )  # type: ignore[return-value]


def _autocast_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As transformers' SDPA under autocast (e.g. TRL's bf16=True on a float32 model, where RoPE
    leaves q/k in float32 and v in bf16): all three in the autocast dtype."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    return query, key, value


def _layout_reasons(
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    lay: PrefixLayout | PaddingFreeLayout,
    dropout: float,
    sliding_window: int | None,
    s_aux: torch.Tensor | None,
    is_causal: bool | None,
) -> list[str]:
    """Why this call cannot run on the layout, kernel aside: each is something the kernel would
    otherwise compute differently from the model's own attention (empty = it can)."""
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
    if is_causal is False and attention_mask is None:  # (with a mask, SDPA's is_causal=False means "use it")
        reasons.append(f"{_where(module)} asks for non-causal attention (is_causal=False, no mask)")
    if attention_mask is not None and tuple(attention_mask.shape[-2:]) != (1, 1):
        reasons.append(
            f"{_where(module)} got an attention mask of shape {list(attention_mask.shape)} instead of the "
            "placeholder: the model built its own mask (e.g. a positional bias), which the kernel would ignore"
        )
    if s_aux is not None and s_aux.numel() != query.shape[1]:
        reasons.append(
            f"attention sinks: expected one per query head ({query.shape[1]}), got {s_aux.numel()}"
        )
    return reasons


def _run_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lay: PrefixLayout | PaddingFreeLayout,
    scale: float,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> torch.Tensor:
    """The layout's kernel on ``[B, H, L, D]`` inputs (checks passed); output ``[B, L, H, Dv]``."""
    if isinstance(lay, PaddingFreeLayout):
        out = padding_free_attention(query, key, value, lay, scale, softcap, s_aux)
    elif lay.kernel == "flex":
        out = _flex(query, key, value, lay, scale, softcap)
    elif lay.kernel == "sdpa":
        out = sdpa_cascade(query, key, value, lay, scale)
    else:  # eager (kernel_reasons refused any other kernel)
        n_rep = query.shape[1] // key.shape[1]
        k, v = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        out_p, out_s = _eager(query, k, v, lay, scale, softcap, s_aux)
        out = torch.cat([out_p, out_s.reshape(*query.shape[:2], -1, value.shape[-1])], dim=2)
    return out.transpose(1, 2).contiguous()


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
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function. With a :class:`PrefixLayout` in
    ``kwargs[LAYOUT_KWARG]`` it computes shared-prefix attention and records ``module`` in the
    layout's ``receipts``; a keyword argument it does not implement raises
    :class:`~grpo_parts.errors.NotSupportedError` (:func:`kwarg_reasons`) instead of being ignored.
    Without a layout (generation, evaluation, an ordinary forward while an adapter keeps this kernel
    selected) it runs the model's own attention -- the implementation selected before
    (:func:`~grpo_parts.compat.own_attention`, with its own mask builder), soft-capping, sinks and
    sliding windows included -- or, for a model built with this kernel, transformers' SDPA."""
    lay: PrefixLayout | PaddingFreeLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if lay is None:
        named = dict(sliding_window=sliding_window, softcap=softcap, s_aux=s_aux, is_causal=is_causal)
        return _fallback_attention(module, query, key, value, attention_mask, dropout, scaling, named, kwargs)
    reasons = kwarg_reasons(module, kwargs)
    lay.receipts.append(module)
    query, key, value = _autocast_qkv(query, key, value)
    reasons += _layout_reasons(module, query, attention_mask, lay, dropout, sliding_window, s_aux, is_causal)
    reasons += kernel_reasons(
        lay.kernel,
        device=query.device,
        dtype=query.dtype,
        softcap=softcap is not None,
        grad=torch.is_grad_enabled(),
        sinks=s_aux is not None,
    )
    if reasons:
        raise NotSupportedError(f"shared_prefix[{lay.kernel}]", reasons)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    return _run_kernel(query, key, value, lay, scale, softcap, s_aux), None
