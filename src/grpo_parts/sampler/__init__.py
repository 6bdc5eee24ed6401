"""Samplers. Select by name with :func:`get_sampler_class` (build with :mod:`grpo_parts.build`);
``"auto"`` walks ``AUTO_PRIORITY``."""

from __future__ import annotations

from ..registry import PartClass, load_class
from .protocol import PromptBatch, Rollout, Sampler, SamplingParams

#: name -> "module:Class", imported lazily.
IMPLEMENTATIONS: dict[str, str] = {
    "reference": "grpo_parts.sampler.reference:ReferenceSampler",
    "speculative": "grpo_parts.sampler.speculative:SpeculativeSampler",
    "vllm": "grpo_parts.sampler.vllm:VLLMSampler",
}
AUTO_PRIORITY: tuple[str, ...] = ("reference",)


def get_sampler_class(name: str) -> PartClass[Sampler]:
    """The class registered as ``name`` (imported on first use); build it with :mod:`grpo_parts.build`."""
    return load_class(IMPLEMENTATIONS, name, "sampler")


__all__ = [
    "AUTO_PRIORITY",
    "IMPLEMENTATIONS",
    "PromptBatch",
    "Rollout",
    "Sampler",
    "SamplingParams",
    "get_sampler_class",
]
