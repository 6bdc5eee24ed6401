"""Samplers. Select by name with :func:`get_sampler_class` (build with :mod:`grpo_parts.build`);
``"auto"`` walks ``AUTO_PRIORITY``."""

from __future__ import annotations

from collections.abc import Callable

from ..registry import PartClass, class_getter
from .protocol import PromptBatch, Rollout, Sampler, SamplingParams

#: name -> "module:Class", imported lazily.
IMPLEMENTATIONS: dict[str, str] = {
    "reference": "grpo_parts.sampler.reference:ReferenceSampler",
    "speculative": "grpo_parts.sampler.speculative:SpeculativeSampler",
    "vllm": "grpo_parts.sampler.vllm:VLLMSampler",
}
AUTO_PRIORITY: tuple[str, ...] = ("reference",)


#: the class registered as a name (imported on first use); build it with :mod:`grpo_parts.build`
get_sampler_class: Callable[[str], PartClass[Sampler]] = class_getter(IMPLEMENTATIONS, "sampler")


__all__ = [
    "AUTO_PRIORITY",
    "IMPLEMENTATIONS",
    "PromptBatch",
    "Rollout",
    "Sampler",
    "SamplingParams",
    "get_sampler_class",
]
