"""The ``Sampler`` Protocol: roll out G completions per prompt and return the policy's log-probs.

Implementations: ``reference.ReferenceSampler`` (plain batched KV-cache sampling). Optimized
samplers (speculative, vLLM) add files here without changing these signatures.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..types import PromptBatch, Rollout

__all__ = ["PromptBatch", "Rollout", "Sampler", "SamplingParams"]


class SamplingParams(BaseModel):
    """How to sample. ``temperature == 0`` means greedy. Processing order (as in transformers):
    temperature, then top-k (``0`` = off), then top-p (``1.0`` = off).

    Returned log-probs are ``log_softmax(logits / temperature)`` of the emitted token (temperature 1
    when greedy), without top-k/top-p: the convention TRL and verl use for the training loss.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(1, ge=1, description="completions per prompt (G)")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = Field(0, ge=0)

    @field_validator("eos_token_ids")
    @classmethod
    def _eos_nonneg(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in v):
            raise ValueError(f"eos_token_ids: expected non-negative token ids, got {v}")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


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
