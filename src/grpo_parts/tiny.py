"""Tiny transformers models built from configs (no hub download), for tests, benchmarks and demos."""

from __future__ import annotations

from typing import Any

import torch

from . import compat
from .errors import GRPOPartsError

_MOE = {"num_experts": 4, "num_experts_per_tok": 2}
#: DeepSeek-V2/V3 attention: q/k heads of 8 + 4 (rotary) dims, v heads of 6, latent K/V rank 8
_MLA = {
    "kv_lora_rank": 8,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}

#: Gemma 3n / Gemma 4 per-layer input embeddings: a table of this many tokens x layers x 8
_PER_LAYER_INPUT = {"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8}

#: family -> (config class path, extra config kwargs). Not every family is supported by every
#: backend or transformers release: see docs/attention.md for the shared-prefix backend's table.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("transformers:LlamaConfig", {}),
    "qwen2": ("transformers:Qwen2Config", {}),
    "qwen3": ("transformers:Qwen3Config", {}),
    "mistral": ("transformers:MistralConfig", {"sliding_window": None}),
    "gemma2": ("transformers:Gemma2Config", {"sliding_window": 4096}),
    "gemma3": ("transformers:Gemma3TextConfig", {"sliding_window": 4096}),
    "phi3": ("transformers:Phi3Config", {}),
    # mixture of experts
    "mixtral": ("transformers:MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "transformers:Qwen2MoeConfig",
        {**_MOE, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    ),
    "qwen3_moe": ("transformers:Qwen3MoeConfig", {**_MOE, "moe_intermediate_size": 16}),
    "olmoe": ("transformers:OlmoeConfig", _MOE),
    "gpt_oss": (  # attention sinks, sliding window on every other layer
        "transformers:GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "rope_scaling": None},
    ),
    # LayerNorm, learned absolute positions
    "gpt2": ("transformers:GPT2Config", {}),
    "opt": ("transformers:OPTConfig", {"ffn_dim": 64}),
    "biogpt": ("transformers:BioGptConfig", {}),
    # partial rotary
    "phi": ("transformers:PhiConfig", {}),
    "gpt_neox": ("transformers:GPTNeoXConfig", {}),
    "persimmon": ("transformers:PersimmonConfig", {}),
    # more rotary decoders
    "olmo2": ("transformers:Olmo2Config", {}),
    "exaone4": ("transformers:Exaone4Config", {"sliding_window": 4096, "sliding_window_pattern": 2}),
    "smollm3": ("transformers:SmolLM3Config", {}),
    "starcoder2": ("transformers:Starcoder2Config", {"sliding_window": None}),
    "granite": ("transformers:GraniteConfig", {}),
    "glm4": ("transformers:Glm4Config", {}),
    # multi-head latent attention (value head size != query/key head size), MoE after layer 0
    "deepseek_v2": (
        "transformers:DeepseekV2Config",
        {**_MLA, "n_routed_experts": 4, "first_k_dense_replace": 1},
    ),
    "deepseek_v3": (
        "transformers:DeepseekV3Config",
        {**_MLA, "n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    ),
    "gpt_bigcode": ("transformers:GPTBigCodeConfig", {}),  # learned absolute positions, multi-query
    "phimoe": ("transformers:PhimoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # layers that differ (heterogeneous): per-layer MLP widths, per-layer-type head sizes, KV sharing,
    # per-layer input embeddings (small tables here; the real ones hold 262144 rows)
    "gemma3n": (
        "transformers:Gemma3nTextConfig",
        {
            **_PER_LAYER_INPUT,
            "altup_num_inputs": 2,
            "laurel_rank": 4,
            "num_kv_shared_layers": 0,
            "sliding_window": 4096,
        },
    ),
    "gemma4": (
        "transformers:Gemma4TextConfig",
        {**_PER_LAYER_INPUT, "head_dim": 8, "global_head_dim": 16, "sliding_window": 4096},
    ),
    # refused by the shared-prefix backend (docs/attention.md)
    "stablelm": ("transformers:StableLmConfig", {}),
    "falcon": ("transformers:FalconConfig", {}),
    "bloom": ("transformers:BloomConfig", {}),
    "mpt": ("transformers:MptConfig", {}),
    "lfm2": ("transformers:Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
}


def family_missing(family: str) -> str | None:
    """Why ``family`` cannot be built with the installed transformers (no config class), or None."""
    import importlib

    import transformers

    mod, _, cls = FAMILIES[family][0].partition(":")
    if hasattr(importlib.import_module(mod), cls):
        return None
    return f"transformers {transformers.__version__} has no {cls}"


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
    family, else ``"eager"`` (:func:`grpo_parts.compat.attn_implementation`). In float64, MoE experts
    run as a loop (:func:`grpo_parts.compat.use_eager_experts`)."""
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
    kw.update(extra)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    kw.update(overrides)
    config = config_cls(**kw)
    if dtype == torch.float64:
        compat.use_eager_experts(config)
    attn = compat.attn_implementation(compat.causal_lm_class(config), attn_implementation)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


#: qwen2 config keys a llama config has no use for
_QWEN2_ONLY = ("model_type", "architectures", "use_sliding_window", "sliding_window", "max_window_layers",
               "layer_types", "transformers_version", "_name_or_path", "dtype", "torch_dtype")  # fmt: skip


def qwen2_as_llama(model: torch.nn.Module) -> torch.nn.Module:
    """The same function as a ``LlamaForCausalLM``: qwen2 is llama with q/k/v biases, which llama's
    ``attention_bias`` adds with an ``o_proj`` bias, set to 0. Why: from transformers 5 ``AutoTokenizer``
    loads a ``qwen2`` folder with Qwen2's own tokenizer class, whatever ``tokenizer_config.json`` declares,
    which drops the spaces of the built-in character tokenizer; a llama folder keeps its declared class
    (the shipped warm starts and every run's ``model/`` export load with ``AutoTokenizer`` and vLLM)."""
    import transformers

    src: Any = model.config
    if src.model_type != "qwen2" or getattr(src, "use_sliding_window", False):
        raise GRPOPartsError(f"model: expected a qwen2 without sliding window, got {src.model_type!r}")
    kw = {k: v for k, v in src.to_dict().items() if k not in _QWEN2_ONLY}
    config = transformers.LlamaConfig(**{**kw, "attention_bias": True, "mlp_bias": False})
    config._attn_implementation = src._attn_implementation
    llama: Any = transformers.LlamaForCausalLM(config)
    llama = llama.to(next(model.parameters()).dtype)
    missing, unexpected = llama.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any(not k.endswith("o_proj.bias") for k in missing):
        raise GRPOPartsError(f"model: qwen2 -> llama mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for layer in llama.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    llama.generation_config = model.generation_config
    return llama.eval()
