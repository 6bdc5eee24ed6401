"""Tiny transformers models built from configs (no hub download), for tests, benchmarks and demos."""

from __future__ import annotations

from typing import Any

import torch

from . import compat
from .errors import GRPOPartsError

#: family -> (config class path, extra config kwargs)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("transformers:LlamaConfig", {}),
    "qwen2": ("transformers:Qwen2Config", {}),
    "qwen3": ("transformers:Qwen3Config", {}),
    "mistral": ("transformers:MistralConfig", {"sliding_window": None}),
    "gemma2": ("transformers:Gemma2Config", {"sliding_window": 4096}),
    "gemma3": ("transformers:Gemma3TextConfig", {"sliding_window": 4096}),
    "phi3": ("transformers:Phi3Config", {}),
}


def tiny_causal_lm(
    family: str = "qwen2",
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """A randomly initialised decoder-only LM of ``family`` (see :data:`FAMILIES`), in eval mode.
    ``attn_implementation``: None = ``"sdpa"`` where the installed transformers supports it for the
    family, else ``"eager"`` (:func:`grpo_parts.compat.attn_implementation`)."""
    import importlib

    import transformers

    if family not in FAMILIES:
        raise GRPOPartsError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    path, extra = FAMILIES[family]
    mod, _, cls = path.partition(":")
    config_cls = getattr(importlib.import_module(mod), cls)
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if head_dim is not None:
        kw["head_dim"] = head_dim
    kw.update(extra)
    kw.update(overrides)
    config = config_cls(**kw)
    attn = compat.attn_implementation(compat.causal_lm_class(config), attn_implementation)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()
