"""The ``AttentionBackend`` Protocol, at two levels: per-token completion log-probs for a trainer
(:meth:`AttentionBackend.completion_logprobs`, what TRL, verl and OpenRLHF call three times per GRPO
step) and the transformers attention function a backend registers (:meth:`AttentionBackend.register_kernel`).

Optional abilities a backend *declares* by having the members (checked with ``isinstance``):
:class:`ReportsPlan`, :class:`CountsAttentionCalls`, :class:`RankAgreeing` and :class:`Plans`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import GRPOPartsError, check_tensor
from ..types import Rollout, VisionInputs

__all__ = [
    "PLAN_ATTENTION_CALLS",
    "PLAN_CHUNKS",
    "PLAN_GRID_SLOTS",
    "AttentionBackend",
    "CountsAttentionCalls",
    "LogprobBatch",
    "LogprobOutput",
    "Plans",
    "RankAgreeing",
    "ReportsPlan",
]

#: ``last_plan`` keys more than one module writes or reads (the trainer logs ``PLAN_CHUNKS`` as the
#: ``attention_grids`` metric): model calls with rows in them (grids; 1 for a padding-free call) ...
PLAN_CHUNKS = "chunks"
#: ... the token slots of those grids (what one grid per call would run) ...
PLAN_GRID_SLOTS = "grid_slots"
#: ... and the padding-free attention calls per path (a ``Counter``; only when it ran padding-free)
PLAN_ATTENTION_CALLS = "attention_calls"


@dataclass(frozen=True)
class LogprobBatch:
    """``prompt_ids: [N, P]`` left-padded with ``prompt_mask``; ``completion_ids: [N, T]``
    right-padded with ``completion_mask``; ``group_index: [N]`` the prompt of each row.

    Rows with the same ``group_index`` must carry the same prompt (a shared-prefix backend encodes
    it once); they may arrive in any order. ``vision``: the prompts' images (a vision-language
    policy), indexed by ``group_index``; None for text.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    group_index: torch.Tensor
    vision: VisionInputs | None = None

    def __post_init__(self) -> None:
        check_tensor("LogprobBatch.prompt_ids", self.prompt_ids, ndim=2, dtype="int")
        n, p = self.prompt_ids.shape
        check_tensor("LogprobBatch.prompt_mask", self.prompt_mask, shape=[n, p], dtype="bool_or_int")
        check_tensor("LogprobBatch.completion_ids", self.completion_ids, shape=[n, None], dtype="int")
        t = self.completion_ids.shape[1]
        check_tensor("LogprobBatch.completion_mask", self.completion_mask, shape=[n, t], dtype="bool_or_int")
        check_tensor("LogprobBatch.group_index", self.group_index, shape=[n], dtype="int")
        if int(self.group_index.min()) < 0:
            raise GRPOPartsError(
                f"LogprobBatch.group_index: expected values >= 0, got {int(self.group_index.min())}"
            )
        empty = self.prompt_mask.long().sum(-1) == 0
        if bool(empty.any()):
            raise GRPOPartsError(
                f"LogprobBatch.prompt_mask: expected >= 1 prompt token per row, row {int(empty.nonzero()[0])} has 0"
            )
        if self.vision is not None and int(self.group_index.max()) >= len(self.vision.per_prompt):
            raise GRPOPartsError(
                f"LogprobBatch.group_index: expected values < {len(self.vision.per_prompt)} (the prompts "
                f"LogprobBatch.vision holds), got {int(self.group_index.max())}"
            )

    def select(self, rows: torch.Tensor) -> LogprobBatch:
        """Keep ``rows: [K]`` (in that order); ``group_index`` keeps its prompt numbering."""
        return LogprobBatch(
            self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows],
            self.completion_mask[rows], self.group_index[rows], self.vision,
        )  # fmt: skip

    def split(self, calls: tuple[torch.Tensor, ...]) -> list[LogprobBatch]:
        """:meth:`select` of each ``calls`` entry (row indices of one model call)."""
        return [self.select(rows) for rows in calls]

    @classmethod
    def from_rollout(cls, rollout: Rollout) -> LogprobBatch:
        return cls(
            rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask,
            rollout.group_index, rollout.vision,
        )  # fmt: skip


@dataclass(frozen=True)
class LogprobOutput:
    """``logprobs: [N, T]`` (0 where ``completion_mask`` is 0); ``entropies: [N, T]`` or None."""

    logprobs: torch.Tensor
    entropies: torch.Tensor | None = None


@runtime_checkable
class AttentionBackend(Protocol):
    name: ClassVar[str]

    def completion_logprobs(
        self, model: nn.Module, batch: LogprobBatch, temperature: float = 1.0, compute_entropy: bool = False
    ) -> LogprobOutput:
        """Per-token ``log_softmax(logits / temperature)`` of each completion token, differentiable
        w.r.t. the model's parameters when grad is enabled."""
        ...

    def register_kernel(self) -> str | None:
        """Register this backend's attention function with transformers' ``AttentionInterface``
        (idempotent) and return its name, or None when the backend needs no kernel."""
        ...

    def not_supported_reasons(self, model: nn.Module, batch: LogprobBatch | None = None) -> list[str]:
        """Why this backend cannot run ``model`` (and ``batch``, when given); empty = supported."""
        ...


@runtime_checkable
class ReportsPlan(Protocol):
    """A backend that says how its last ``completion_logprobs`` call laid the batch out."""

    #: the last call's plan: ``PLAN_CHUNKS`` (int), ``PLAN_GRID_SLOTS`` (float), ``PLAN_ATTENTION_CALLS``
    #: (Counter) and backend-specific entries (e.g. ``layout``, ``model_calls``); empty before any call
    last_plan: dict[str, Any]


@runtime_checkable
class CountsAttentionCalls(Protocol):
    """A backend that counts its attention calls per path (``varlen_cascade``, ``masked_sdpa``, ...)
    over its lifetime; adapters log the difference between two reads."""

    attention_calls: Counter[str]


@runtime_checkable
class RankAgreeing(Protocol):
    """A backend whose ranks must make the same number of model calls (FSDP / ZeRO / DDP run
    collectives in every forward): ``rank_group`` is the process group that agrees (None: all ranks,
    or one process). Adapters set it to their data-parallel group and read it to agree likewise."""

    rank_group: Any


@runtime_checkable
class Plans(Protocol):
    """A backend that plans each call before running it (the shared-prefix backend's
    :mod:`~grpo_parts.attention.shared_prefix.plan`): adapters that must agree with other ranks on
    more than its model calls ask for the plan without agreement, agree, and run it."""

    layout: str

    def plan(self, model: nn.Module, batch: LogprobBatch, *, packed: bool = False, agree: bool = True) -> Any:
        """The call's plan: ``.layout``, ``.tokens``, ``.packed_tokens``, ``.model_calls``,
        ``.agreed(calls)`` (the plan making ``calls`` model calls) and ``.info()``."""
        ...

    def run(
        self,
        model: nn.Module,
        batch: LogprobBatch,
        plan: Any,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> LogprobOutput:
        """Run ``plan`` on ``batch`` (what ``completion_logprobs`` does after planning)."""
        ...
