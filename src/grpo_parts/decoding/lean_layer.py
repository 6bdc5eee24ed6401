"""One Llama-family decoder layer as plain tensor operations (the sampler's lean forward and the
EAGLE head's drafting path share it, so it lives below both packages).

The modeling code's maths in the same order, without the module calls and keyword plumbing (which
on a CPU cost as much as a small layer's arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

#: model types whose decoder layer is the Llama layer (pre-norm RMSNorm, rotary q/k, SwiGLU MLP);
#: the value: the layer normalises q and k per head before the rotation (Qwen3)
ARCHITECTURES = {"llama": False, "qwen2": False, "mistral": False, "qwen3": True}
#: RMSNorm classes whose forward is ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)``
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm")


def layer_reasons(layers: Sequence[Any], qk_norm: bool) -> list[str]:
    """Why :func:`lean_layer` cannot stand in for one of ``layers`` (empty: it can for all)."""
    for i, ly in enumerate(layers):
        attn, mlp = getattr(ly, "self_attn", None), getattr(ly, "mlp", None)
        lins = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        lins += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        bad = [m for m in lins if type(m) is not torch.nn.Linear]
        if bad:
            return [f"model: layer {i} has a {type(bad[0]).__name__} projection, not a plain Linear"]
        norms = [getattr(ly, "input_layernorm", None), getattr(ly, "post_attention_layernorm", None)]
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)] if qk_norm else []
        if any(type(n).__name__ not in RMS_NORMS for n in norms):
            return [f"model: layer {i} has a norm outside {', '.join(RMS_NORMS)}"]
        if getattr(attn, "head_dim", None) is None or getattr(attn, "scaling", None) is None:
            return [f"model: layer {i}'s attention has no head_dim/scaling"]
    return []


def rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """The RMSNorm classes of :data:`RMS_NORMS` (float32 inside, as they are), with torch's own
    ``rms_norm`` for ``x * rsqrt(mean(x^2) + eps)``: one call instead of five small ones."""
    h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)  # type: ignore[no-any-return]


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary module's ``cos, sin: [A, T, D]`` as :func:`lean_layer` takes them: ``[A, 1, T, D]``,
    with the sign of ``rotate_half`` folded into the first half of ``sin`` (once per forward)."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), -1).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` of the Llama family for one tensor: ``rotate_half(x) * sin`` is
    ``roll(x, D/2) * signed_sin`` (the same products, negation being exact)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * signed_sin)


def lean_layer(
    ly: Any, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None, cache: Any,
    idx: int, attention: Callable[..., Any], extra: dict[str, Any], qk_norm: bool,
) -> torch.Tensor:  # fmt: skip
    """Decoder layer ``ly`` on ``h: [A, T, d]``: ``rope`` from :func:`rope_tables`, ``mask`` as
    the attention function takes it, new K/V appended with ``cache.update(k, v, idx)``,
    ``attention`` called as the model's attention module calls it (``extra``: its keywords)."""
    at, mlp = ly.self_attn, ly.mlp
    a, t = h.shape[0], h.shape[1]
    x = rms_norm(h, ly.input_layernorm)
    shape = (a, t, -1, at.head_dim)
    q, k = F.linear(x, at.q_proj.weight, at.q_proj.bias), F.linear(x, at.k_proj.weight, at.k_proj.bias)
    v = F.linear(x, at.v_proj.weight, at.v_proj.bias).view(shape).transpose(1, 2)
    q, k = q.view(shape), k.view(shape)
    if qk_norm:
        q, k = rms_norm(q, at.q_norm), rms_norm(k, at.k_norm)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    k, v = cache.update(k, v, idx)
    o, _ = attention(at, q, k, v, mask, dropout=0.0, scaling=at.scaling, **extra)
    h = h + F.linear(o.reshape(a, t, -1).contiguous(), at.o_proj.weight, at.o_proj.bias)
    x = rms_norm(h, ly.post_attention_layernorm)
    g = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
    up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
    return h + F.linear(g * up, mlp.down_proj.weight, mlp.down_proj.bias)
