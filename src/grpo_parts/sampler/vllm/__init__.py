"""vLLM as a grpo_parts ``Sampler`` (:class:`VLLMSampler`), with FastGRPO's draft length per batch
size and online draft on vLLM's speculative path (:mod:`.online_draft`). vLLM is imported lazily."""

from .config import KRange, OnlineDraftConfig, VLLMConfig, VLLMSpeculative, check_k_table
from .sampler import (
    COUNTERS,
    CPU_HEAD_SIZES,
    VERIFIED_SPECULATIVE_ON_CPU,
    VLLMSampler,
    model_reasons,
    vllm_missing_reason,
)

__all__ = [
    "COUNTERS",
    "CPU_HEAD_SIZES",
    "VERIFIED_SPECULATIVE_ON_CPU",
    "KRange",
    "OnlineDraftConfig",
    "VLLMConfig",
    "VLLMSampler",
    "VLLMSpeculative",
    "check_k_table",
    "model_reasons",
    "vllm_missing_reason",
]
