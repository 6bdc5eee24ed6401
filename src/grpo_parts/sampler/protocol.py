"""The ``Sampler`` Protocol: roll out G completions per prompt and return the policy's log-probs.

Optional abilities a sampler *declares* by having the members (checked with ``isinstance``):
:class:`TrainsDraft` and :class:`TracesDecode`. Shared ``Rollout.stats`` keys: :mod:`grpo_parts.sampler.stats`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..decoding import SamplingParams
from ..draft.protocol import DraftTrainingBatch
from ..types import PromptBatch, Rollout

__all__ = [
    "IMAGE_PROMPTS_REASON",
    "image_prompt_reasons",
    "DecodeTraceView",
    "PromptBatch",
    "Rollout",
    "Sampler",
    "SamplingParams",
    "TracesDecode",
    "TrainsDraft",
]

#: why a sampler other than the reference refuses a :class:`PromptBatch` with images (one line for all)
IMAGE_PROMPTS_REASON = (
    "PromptBatch.vision: image prompts are rolled out by the reference sampler only so far "
    "(docs/attention.md, 'Vision-language policies')"
)


def image_prompt_reasons(sampler: object) -> list[str]:
    """Why ``sampler`` cannot roll out image prompts (empty: it can). A sampler declares that it
    can with a class attribute ``takes_images = True``."""
    return [] if getattr(sampler, "takes_images", False) else [IMAGE_PROMPTS_REASON]


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


@runtime_checkable
class TrainsDraft(Protocol):
    """A sampler that can feed a learnable draft: the trainer calls it on each rollout of a step and
    passes the batch to ``DraftModel.update`` (the speculative sampler)."""

    def draft_training_batch(self, rollout: Rollout) -> DraftTrainingBatch:
        """The policy's view of ``rollout`` (``N`` rows, ``L = P + T`` positions):
        ``input_ids``/``attention_mask``/``loss_mask: [N, L]``, ``hidden: [N, L, H]`` its last hidden
        states, ``target_logits: [N, L, V]`` its logits; ``loss_mask`` marks positions whose next
        token the policy emitted."""
        ...


class DecodeTraceView(Protocol):
    """One rollout's per-decode-step trace (:class:`~grpo_parts.sampler.speculative.trace.DecodeTrace`)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-able lists, one entry per decode step: ``active`` rows, ``k`` draft nodes per row (0 =
        plain), ``tokens`` emitted per row, ``acceptance``, ``depth``, ``width``, and the cost model's
        ``break_even``, ``t_plain_ms``, ``t_spec_ms`` (None on speculative steps)."""
        ...


@runtime_checkable
class TracesDecode(Protocol):
    """A sampler that records what it did at each decode step of its last ``generate`` (the
    speculative sampler); the trainer writes it to ``decode_trace.json``."""

    @property
    def last_trace(self) -> DecodeTraceView:
        """The last rollout's trace (replaced by each ``generate``)."""
        ...
