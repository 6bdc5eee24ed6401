"""Tiny float32 models the vLLM CPU backend accepts (head size 64) and the shared engine settings."""

from __future__ import annotations

import torch

from grpo_parts.tiny import tiny_causal_lm

V = 16  # small vocabulary: sequence distributions can be enumerated for the chi-square tests
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=256, cpu_kvcache_space_gib=1)


def tiny_lm(seed: int, layers: int = 2, scale: float = 6.0) -> torch.nn.Module:
    """hidden 128, 2 heads -> head_dim 64 (a CPU attention size); lm_head scaled so sampling is peaked."""
    m = tiny_causal_lm(
        "qwen2", vocab_size=V, hidden_size=128, num_layers=layers, num_heads=2, num_kv_heads=1, seed=seed
    )
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return m
