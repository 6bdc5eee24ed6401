"""vLLM as a grpo_parts ``Sampler`` (:class:`VLLMSampler`), with FastGRPO's draft length per batch
size and online draft on vLLM's speculative path (:mod:`.online_draft`). vLLM is imported lazily."""

from .config import OnlineDraftConfig, VLLMConfig, VLLMSpeculative, check_k_table
from .sampler import VERIFIED_SPECULATIVE_ON_CPU, VLLMSampler, vllm_missing_reason

__all__ = [
    "VERIFIED_SPECULATIVE_ON_CPU",
    "OnlineDraftConfig",
    "VLLMConfig",
    "VLLMSampler",
    "VLLMSpeculative",
    "check_k_table",
    "vllm_missing_reason",
]
