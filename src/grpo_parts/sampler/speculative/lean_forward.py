"""A lean cached forward of Llama-family policies for the speculative sampler's decode loop.

A small policy's decode forward is mostly transformers' per-call overhead (docs/results.md, "Lean
decode forward"), so this path calls the policy's own weights, rotary module, KV cache and attention
function with the modeling code's maths in the same order (:mod:`grpo_parts.decoding.lean_layer`),
exact up to float rounding. docs/speculative.md, "Decode forwards without the framework's overhead".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...compat import own_attention, own_attention_function
from ...decoding.lean_layer import ARCHITECTURES, RMS_NORMS, layer_reasons, lean_layer, rms_norm, rope_tables
from ...errors import NotSupportedError
from .forward_chain import ForwardChain, forward_chain
from .model_support import sliding_window

#: attention implementations the path calls (the decode kernel falls back to SDPA itself)
ATTENTIONS = ("sdpa", "grpo_decode_shared_prompt")


@dataclass
class LeanOutput:
    """What the decode loop reads of a forward: ``logits: [A, T, V]`` and, when asked for, the last
    hidden states (``hidden_states[-1]``, after the final norm, as the model's own output)."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None


def lean_forward_reasons(model: torch.nn.Module) -> list[str]:
    """Why :class:`LeanForward` cannot stand in for ``model``'s forward (empty: it can)."""
    cfg: Any = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in ARCHITECTURES:
        return [f"model: model_type {mtype!r} (lean forward serves {', '.join(sorted(ARCHITECTURES))})"]
    inner: Any = getattr(model, "model", None)
    out: list[str] = []
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(inner, name, None) is None:
            out.append(f"model: {type(model).__name__}.model has no {name}")
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear:
        out.append(f"model: lm_head is {type(head).__name__}, not a plain Linear")
    if out:
        return out
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        out.append(f"model: embed_tokens is {type(inner.embed_tokens).__name__}, not a plain Embedding")
    if getattr(cfg, "hidden_act", None) != "silu":
        out.append(f"model: hidden_act {getattr(cfg, 'hidden_act', None)!r} (lean forward: 'silu')")
    if sliding_window(model) is not None or _has_window(inner):
        out.append("model: sliding-window attention (its masks are the model's own)")
    if model.training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0.0:
        out.append(f"model: in training mode with attention_dropout={cfg.attention_dropout}")
    if len(inner.layers) < int(getattr(cfg, "num_hidden_layers", 0) or 0):
        out.append("model: fewer layers than config.num_hidden_layers")
    out += _module_reasons(model)
    return out[:4]


def _has_window(inner: Any) -> bool:
    """A layer that sets a window of its own (Qwen2/Qwen3 per layer type)."""
    return any(getattr(getattr(ly, "self_attn", None), "sliding_window", None) for ly in inner.layers)


#: submodules the lean path calls as modules (their hooks and forwards run as in the model's own
#: forward; e.g. the embedding hook transformers adds for gradient checkpointing)
CALLED_MODULES = ("model.embed_tokens", "model.rotary_emb")


def _module_reasons(model: Any) -> list[str]:
    """Hooks, wrapped (LoRA, quantised, sharded) projections and unexpected norms: the path reads weights
    directly, so anything that changes a module's call would be skipped silently. The model's own forward may
    be replaced by wrappers :func:`.forward_chain.forward_chain` knows (the lean path reproduces them)."""
    from torch.nn.modules import module as nn_module

    out: list[str] = []
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        out.append("torch: global module forward hooks are registered")
    why = top_forward_chain(model)[1]
    if why:  # e.g. a wrapper of the forward the lean path does not know
        out.append(why)
    patched, hooked = [], []  # one walk over the modules (checked once per rollout)
    for n, m in model.named_modules():
        if n in CALLED_MODULES:
            continue
        if n and _replaced_forward(m):  # the model's own: top_forward_chain
            patched.append(n)
        if any(not _capturing(h) for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())):
            hooked.append(n)
    if patched:
        out.append(f"model: {patched[0]}.forward is replaced on the instance")
    if hooked:
        more = f" and {len(hooked) - 1} more" if len(hooked) > 1 else ""
        out.append(f"model: forward hooks on {hooked[0]!r}{more}")
    out += layer_reasons(model.model.layers, ARCHITECTURES[model.config.model_type])
    if type(model.model.norm).__name__ not in RMS_NORMS:
        out.append("model: final norm is not an RMSNorm of the table")
    return out


def top_forward_chain(model: Any) -> tuple[ForwardChain | None, str | None]:
    """What the model's own (possibly instance-replaced) forward does around its class's forward
    (:func:`.forward_chain.forward_chain`); transformers' capture wrapper counts as none."""
    if _capturing(model.__dict__.get("forward")):
        return ForwardChain(), None
    return forward_chain(model)


def _replaced_forward(m: torch.nn.Module) -> bool:
    """``m.forward`` is set on the instance to something other than its class's own forward bound
    to it (transformers 4.5x leaves exactly that behind after capturing outputs) or transformers'
    capture wrapper."""
    f = m.__dict__.get("forward")
    if f is None or _capturing(f):
        return False
    return not (getattr(f, "__self__", None) is m and getattr(f, "__func__", None) is type(m).forward)


def _capturing(hook: Any) -> bool:
    """transformers' own output capturing: hooks (5.x) or forward wrappers (4.5x) installed on a
    model's first forward with ``output_hidden_states``; they record only inside such a forward,
    and the lean path returns the one hidden state the loop reads itself."""
    mod, name = getattr(hook, "__module__", "") or "", getattr(hook, "__qualname__", "") or ""
    return mod.startswith("transformers.utils") and "captur" in name.lower()


class LeanForward:
    """``LeanForward(model)(input_ids, attention_mask, position_ids, cache, need_h, extra)``: one
    cached forward of ``input_ids: [A, T]``; ``attention_mask`` is 2-D ``[A, L + T]`` (0 = padding
    or hole) or an already prepared 4-D mask (tree verification), which is passed as it is, as the
    model's own mask code does. ``extra`` goes to the attention function (the decode layout)."""

    def __init__(self, model: Any, checked: bool = False):
        reasons = [] if checked else lean_forward_reasons(model)
        if reasons:
            raise NotSupportedError("lean forward", reasons)
        self.model: Any = model
        self.qk_norm = ARCHITECTURES[model.config.model_type]
        #: what the model's own forward runs under (accelerate's autocast and float32 outputs)
        chain = top_forward_chain(model)[0]
        self.chain = None if chain is None or chain.plain else chain

    def attention_reasons(self) -> list[str]:
        """Why the current attention implementation is not served (checked per rollout: the decode
        kernel is selected only inside the loop)."""
        impl = self.model.config._attn_implementation
        if impl not in ATTENTIONS:
            return [f"model: attention {impl!r} (lean forward: {' or '.join(ATTENTIONS)})"]
        if impl == ATTENTIONS[1]:
            own = own_attention(self.model.config)
            if own != "sdpa":
                return [f"model: attention {own!r} under the decode kernel (lean forward: 'sdpa')"]
        return []

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        cache: Any, need_h: bool = False, extra: dict[str, Any] | None = None,
    ) -> LeanOutput:  # fmt: skip
        if self.chain is None:
            return self._forward(input_ids, attention_mask, position_ids, cache, need_h, extra)
        with self.chain.scope():  # the autocast the model's own forward runs under
            out = self._forward(input_ids, attention_mask, position_ids, cache, need_h, extra)
        h = None if out.hidden_states is None else tuple(self.chain.output(x) for x in out.hidden_states)
        return LeanOutput(self.chain.output(out.logits), h)

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        cache: Any, need_h: bool, extra: dict[str, Any] | None,
    ) -> LeanOutput:  # fmt: skip
        m = self.model
        inner, cfg = m.model, m.config
        h = inner.embed_tokens(input_ids)
        t = input_ids.shape[1]
        rope = rope_tables(*inner.rotary_emb(h, position_ids=position_ids))
        mask = attention_mask if attention_mask.dim() == 4 else _bool_mask(attention_mask, t)
        layers = inner.layers[: cfg.num_hidden_layers]
        fn = own_attention_function(layers[0].self_attn, cfg._attn_implementation)
        assert fn is not None, cfg._attn_implementation  # attention_reasons() admitted only registered ones
        kw = extra or {}
        for i, ly in enumerate(layers):
            h = lean_layer(ly, h, rope, mask, cache, i, fn, kw, self.qk_norm)
        h = rms_norm(h, inner.norm)
        return LeanOutput(F.linear(h, m.lm_head.weight, m.lm_head.bias), (h,) if need_h else None)


def _bool_mask(mask2d: torch.Tensor, t: int) -> torch.Tensor:
    """The SDPA mask of a 2-D padding mask ``[A, L]`` for the last ``t`` columns' queries: column
    ``c`` is visible to query ``i`` when ``mask2d[c] != 0`` and ``c <= L - t + i`` (causal)."""
    n = mask2d.shape[1]
    causal = torch.ones(t, n, dtype=torch.bool, device=mask2d.device).tril(n - t)
    return mask2d.bool()[:, None, None, :] & causal


def lean_forward_for(model: torch.nn.Module, mode: str) -> tuple[LeanForward | None, list[str]]:
    """The lean forward for ``model`` under its current attention selection (call it inside the
    decode kernel's block), or None and why not. ``mode`` is ``SpeculativeConfig.lean_forward``:
    ``"auto"`` serves where it can, ``"off"`` never, ``"on"`` raises where it cannot."""
    if mode == "off":
        return None, ["config: lean_forward='off'"]
    reasons = lean_forward_reasons(model)
    lean = None if reasons else LeanForward(model, checked=True)
    reasons = reasons or (lean.attention_reasons() if lean is not None else [])
    if reasons and mode == "on":
        raise NotSupportedError("lean forward (lean_forward='on')", reasons)
    return (None if reasons else lean), reasons
