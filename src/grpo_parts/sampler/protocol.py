"""The ``Sampler`` Protocol: roll out G completions per prompt and return the policy's log-probs.

Implementations: ``reference.ReferenceSampler`` (plain batched KV-cache sampling). Optimized
samplers (speculative, vLLM) add files here without changing these signatures.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from ..decoding import SamplingParams
from ..types import PromptBatch, Rollout

__all__ = ["PromptBatch", "Rollout", "Sampler", "SamplingParams"]


@runtime_checkable
class Sampler(Protocol):
    """Generates ``params.group_size`` completions for each prompt of a batch.

    Rows of the returned :class:`Rollout` are ordered prompt-major: row ``b * G + g`` is completion
    ``g`` of prompt ``b``, and ``group_index[b * G + g] == b``.
    """

    name: ClassVar[str]

    def generate(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        """Sample ``[B * G]`` completions. ``generator`` makes sampling reproducible."""
        ...

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Called after every policy update: load the new weights (no-op when the sampler holds
        the training module itself)."""
        ...

    def not_supported_reasons(self, params: SamplingParams) -> list[str]:
        """Why this sampler cannot serve ``params`` on its model (empty list = supported)."""
        ...
