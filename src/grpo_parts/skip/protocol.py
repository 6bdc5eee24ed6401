"""The ``PromptSkipper`` Protocol: skip prompts *before* rollout, unbiasedly.

A prompt whose groups had zero reward variance in earlier epochs (every completion the same reward:
zero advantage, zero policy gradient) is likely to have it again (GRESO, arXiv 2506.02177), so a
skipper keeps each drawn prompt with an *inclusion probability* ``p`` read from its history, and the
prompts it keeps carry the weight ``1 / p``: with a loss normaliser fixed before the draw (the drawn
prompts' sequence count), the expected loss and gradient are those of the whole drawn batch
(docs/filter.md, "Skipping prompts before rollout"; tests/skip/test_prompt_skip.py proves it).

Prompts are named by a stable integer id (:func:`prompt_key`: a hash of the prompt's text, or the
problem's index in the dataset).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

import torch

from ..core import AdvantageConfig, LossConfig
from ..core.unbiased import loss_facts, refusal_reasons
from ..errors import GRPOPartsError, check_tensor

__all__ = [
    "DrawsPrompts",
    "PeeksPrompts",
    "PromptId",
    "PromptSkipper",
    "ReportsHistory",
    "SkipDecision",
    "prompt_id",
    "prompt_key",
    "prompt_skip_reasons",
    "skips",
]

#: a prompt's stable id: the problem's index in the dataset, or :func:`prompt_key` of its text
PromptId = int
P_co = TypeVar("P_co", covariant=True)


def prompt_key(text: str) -> PromptId:
    """A stable 63-bit id of a prompt's text (BLAKE2b; the same in every process and run, unlike
    ``hash()``), an int64 that a checkpoint stores as a tensor."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def prompt_id(prompt: Any) -> PromptId:
    """The id of a framework's prompt: :func:`prompt_key` of its text, or of its chat messages as
    canonical JSON (the one rule the TRL and OpenRLHF doors share)."""
    return prompt_key(prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str))


@dataclass(frozen=True)
class SkipDecision:
    """The outcome of :meth:`PromptSkipper.decide` on ``D`` drawn prompts. ``kept: [K]`` int64 positions
    (into the drawn list, ascending) of the prompts to roll out; ``weights: [K]`` float64 ``1 / p`` of
    each, or None (every prompt kept, weight 1: the reference); ``probabilities: [D]`` float64, every drawn
    prompt's inclusion probability ``p`` (> 0)."""

    kept: torch.Tensor
    weights: torch.Tensor | None
    probabilities: torch.Tensor
    info: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_tensor(
            "SkipDecision.probabilities", self.probabilities, ndim=1, dtype="float", allow_empty=True
        )
        check_tensor("SkipDecision.kept", self.kept, ndim=1, dtype=torch.long, allow_empty=True)
        if self.weights is not None:
            check_tensor(
                "SkipDecision.weights", self.weights, shape=[len(self.kept)], dtype="float", allow_empty=True
            )
        if self.kept.numel() > 1 and bool((self.kept[1:] <= self.kept[:-1]).any()):
            raise GRPOPartsError("SkipDecision.kept: expected strictly ascending positions")

    @property
    def num_drawn(self) -> int:
        return int(self.probabilities.numel())

    @property
    def skipped(self) -> torch.Tensor:
        """``[D - K]`` positions of the skipped prompts, ascending."""
        mask = torch.ones(self.num_drawn, dtype=torch.bool)
        mask[self.kept.cpu()] = False
        return mask.nonzero().flatten()


@runtime_checkable
class PromptSkipper(Protocol):
    """Decide, before rollout, which drawn prompts to roll out; learn from the rewards after.
    ``min_keep_prob`` (> 0; 1 = never skips) floors every inclusion probability and bounds a round's draw
    (``n / min_keep_prob``); ``step_size`` and ``min_rollout_share`` say how a skip pays
    (:class:`~.draw.PromptDraw`; docs/filter.md, "Skipping prompts before rollout")."""

    name: ClassVar[str]
    min_keep_prob: float
    step_size: Literal["fill", "fewer"]
    min_rollout_share: float

    def inclusion_probability(self, prompt_id: PromptId) -> float:
        """``p`` of a prompt drawn now, from its history alone (1 without zero-variance history)."""
        ...

    def decide(
        self,
        prompt_ids: Sequence[PromptId],
        generator: torch.Generator | None = None,
        target: float | None = None,
    ) -> SkipDecision:
        """Keep each drawn prompt with its probability (scaled down so they sum to ``target``, the
        prompts wanted, when they sum to more); ``generator``: None = the skipper's own."""
        ...

    def observe(
        self,
        prompt_ids: Sequence[PromptId],
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """Record the rolled-out groups: ``rewards: [N]`` (the raw rewards), ``group_index: [N]``
        (row -> position in ``prompt_ids``), ``lengths: [N]`` completion tokens; adapts the rule."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class ReportsHistory(Protocol):
    """A skipper that can say how much it remembers and how long a prompt's completions were."""

    def history_stats(self) -> dict[str, float]:
        """Diagnostics as plain floats (``history_size``: prompts remembered, ...)."""
        ...

    def mean_completion_length(self, prompt_id: PromptId) -> float | None:
        """The prompt's recent mean completion length in tokens (None: never rolled out)."""
        ...


@runtime_checkable
class PeeksPrompts(Protocol[P_co]):
    """A prompt stream that can show its next prompt without consuming it (the trainer's)."""

    def peek(self) -> P_co:
        """The prompt ``next()`` would return (``StopIteration`` when there is none)."""
        ...

    def __next__(self) -> P_co: ...


@runtime_checkable
class DrawsPrompts(Protocol[P_co]):
    """A prompt stream that hands out a round of ``n`` prompts at once, after skipping
    (:class:`~.draw.PromptDraw`; :func:`grpo_parts.filter.refill.fill_rollouts` takes such a round)."""

    def take(self, n: int) -> Sequence[P_co]:
        """Up to ``n`` prompts to roll out (fewer when the stream runs out)."""
        ...


def skips(skipper: PromptSkipper | None) -> bool:
    """Whether ``skipper`` can skip at all (the reference, ``min_keep_prob = 1``, cannot)."""
    return skipper is not None and skipper.min_keep_prob < 1.0


def prompt_skip_reasons(advantage: AdvantageConfig, loss: LossConfig, empty_rows: bool = True) -> list[str]:
    """Why skipping with ``1 / p`` weights would not give the drawn batch's expected gradient under
    these configs (empty list = it does): the rule of :mod:`grpo_parts.core.unbiased` with the
    normaliser fixed before the draw, the drawn prompts' rows. ``empty_rows``: rows without a
    completion token can occur (the trainer's sampler always emits one: False there)."""
    facts = loss_facts(loss, "prompt skipping", "drawn", empty_rows, prefix="loss.")
    per_group = "expected a per-group estimator (grpo with norm 'group' or 'none', rloo)"
    stats = []
    if advantage.norm == "batch":
        stats.append(("advantage.norm='batch'", per_group))
    elif advantage.estimator == "reinforce_plus_plus_baseline":
        stats.append(("estimator 'reinforce_plus_plus_baseline'", per_group))
    return refusal_reasons(replace(facts, batch_statistics=tuple(stats)))
