"""The ``DraftModel`` Protocol: propose tokens, with the distribution drawn from, for a speculative
sampler to verify losslessly; learnable drafts train after each rollout (:meth:`DraftModel.update`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..decoding import SamplingParams
from ..errors import GRPOPartsError, check_tensor

__all__ = [
    "DraftContext",
    "DraftModel",
    "DraftProposal",
    "DraftTrainingBatch",
    "StatelessDraft",
    "TreeBudget",
    "TreeDraftModel",
]


@dataclass(frozen=True)
class DraftContext:
    """The rows a draft should extend.

    ``tokens: [A, L]`` every token so far (prompt + emitted), **right-aligned**: row ``a`` holds its
    ``lengths[a]`` real tokens in ``tokens[a, L - lengths[a]:]``, left-padded with ``pad_token_id``.
    ``rows: [A]`` stable ids of these rows inside the rollout (so stateful drafts can keep
    per-row caches as rows finish). ``group_index: [A]`` the prompt of each row (history drafts
    use sibling completions). ``hidden: [A, H]`` the policy's last-layer hidden state at the last
    position, or None when the draft does not declare ``needs_hidden_states``.

    ``new_hidden: [A, M, H]`` and ``num_new: [A]`` (only for drafts with ``needs_hidden_states``):
    the policy's hidden states computed since the previous ``propose`` for the row (the whole prompt
    on the first call), right-aligned: the last ``num_new[a]`` entries are the states at the
    positions of ``tokens[a, L-1-num_new[a] : L-1]``, i.e. those that predicted the row's last
    ``num_new[a]`` tokens (``hidden == new_hidden[:, -1]``). A KV-cached head feeds exactly these.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor
    group_index: torch.Tensor
    hidden: torch.Tensor | None = None
    new_hidden: torch.Tensor | None = None
    num_new: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("DraftContext.tokens", self.tokens, ndim=2, dtype="int")
        a = self.tokens.shape[0]
        check_tensor("DraftContext.lengths", self.lengths, shape=[a], dtype="int")
        check_tensor("DraftContext.rows", self.rows, shape=[a], dtype="int")
        check_tensor("DraftContext.group_index", self.group_index, shape=[a], dtype="int")
        if self.hidden is not None:
            check_tensor("DraftContext.hidden", self.hidden, shape=[a, None], dtype="float")
        if (self.new_hidden is None) != (self.num_new is None):
            raise GRPOPartsError("DraftContext.new_hidden/num_new: expected both or neither to be given")
        if self.new_hidden is not None and self.num_new is not None:
            check_tensor("DraftContext.new_hidden", self.new_hidden, shape=[a, None, None], dtype="float")
            check_tensor("DraftContext.num_new", self.num_new, shape=[a], dtype="int")
            m = self.new_hidden.shape[1]
            if bool((self.num_new < 1).any()) or bool((self.num_new > m).any()):
                raise GRPOPartsError(
                    f"DraftContext.num_new: expected values in [1, {m}] (new_hidden has {m} entries per row), "
                    f"got range [{int(self.num_new.min())}, {int(self.num_new.max())}]"
                )
        if bool((self.lengths < 1).any()) or bool((self.lengths > self.tokens.shape[1]).any()):
            raise GRPOPartsError(
                f"DraftContext.lengths: expected values in [1, {self.tokens.shape[1]}], "
                f"got range [{int(self.lengths.min())}, {int(self.lengths.max())}]"
            )


@dataclass(frozen=True)
class DraftProposal:
    """A draft **tree** per row: ``tokens: [A, N]`` the nodes' tokens; ``parents: [A, N]`` each
    node's parent node (``-1`` = the row's last emitted token, the root; always ``< i``, so a
    parent precedes its children); ``probs: [A, N, V]`` the (already processed: temperature /
    top-k / top-p) distribution node ``i`` was drawn from at its parent's context, or None for a
    deterministic draft (a point mass on the proposed token, e.g. n-gram lookup or top-K expansion).

    ``parents=None`` is a **chain** (``parents[i] = i - 1``), the width-1 case every draft
    supports; chains are verified by residual rejection sampling (accepts more for *sampled* drafts),
    deterministic trees by sample-then-match (docs/speculative.md).

    ``sampled=True`` (a tree with ``probs``): each node's children were drawn **without replacement**
    from their parent's ``probs`` (siblings share it), in node order, and which children exist did
    not depend on the drawn values (:mod:`grpo_parts.draft.tree_sampled`); such trees are verified by
    recursive rejection sampling (:func:`~grpo_parts.sampler.speculative.tree_verify.verify_sampled_tree`).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    sampled: bool = False

    def __post_init__(self) -> None:
        check_tensor("DraftProposal.tokens", self.tokens, ndim=2, dtype="int", allow_empty=True)
        a, k = self.tokens.shape
        if self.probs is not None:
            check_tensor(
                "DraftProposal.probs", self.probs, shape=[a, k, None], dtype="float", allow_empty=True
            )
        if self.sampled and (self.probs is None or self.parents is None):
            raise GRPOPartsError(
                "DraftProposal.sampled: expected probs and parents with sampled=True, got None"
            )
        if self.parents is not None:
            check_tensor("DraftProposal.parents", self.parents, shape=[a, k], dtype="int", allow_empty=True)
            idx = torch.arange(k, device=self.parents.device)
            if k and (bool((self.parents < -1).any()) or bool((self.parents >= idx).any())):
                raise GRPOPartsError(
                    "DraftProposal.parents: expected -1 <= parents[:, i] < i (a parent precedes its children), "
                    f"got {self.parents.tolist()}"
                )

    def chain_parents(self) -> torch.Tensor:
        """``parents``, with a chain's spelled out."""
        if self.parents is not None:
            return self.parents
        a, k = self.tokens.shape
        return (torch.arange(k, device=self.tokens.device) - 1).expand(a, k)


@dataclass(frozen=True)
class TreeBudget:
    """How big a tree the sampler wants per row: ``nodes`` drafted tokens in all, at most ``depth``
    levels below the root, at most ``width`` children per node (a chain: ``width == 1``)."""

    nodes: int
    depth: int
    width: int

    def __post_init__(self) -> None:
        if not (self.nodes >= 1 and self.depth >= 1 and self.width >= 1):
            raise GRPOPartsError(f"TreeBudget: expected nodes, depth, width >= 1, got {self}")


@dataclass(frozen=True)
class DraftTrainingBatch:
    """What a learnable draft distils from after a rollout, at the rollout's real positions.

    ``input_ids: [N, L]`` prompt+completion (left-padded prompt, right-padded completion),
    ``loss_mask: [N, L]`` 1 at positions whose next token was emitted by the policy,
    ``hidden: [N, L, H]`` the policy's last hidden states, ``target_logits: [N, L, V]`` the
    policy's logits (next-token distributions) at those positions.
    ``attention_mask: [N, L]`` 1 at real tokens (prompt padding and completion padding are 0);
    None means every position is real.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor | None
    target_logits: torch.Tensor | None
    attention_mask: torch.Tensor | None = None


@runtime_checkable
class DraftModel(Protocol):
    name: ClassVar[str]
    #: True when ``update`` trains weights (the sampler then calls it after each rollout).
    learnable: ClassVar[bool]
    #: True when ``propose`` reads ``DraftContext.hidden`` (the sampler must supply it).
    needs_hidden_states: ClassVar[bool]

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        """Start of a rollout: ``prompts: [N, P]`` left-padded rows about to be generated."""
        ...

    def propose(
        self, context: DraftContext, num_tokens: int, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        """Draft ``num_tokens`` tokens for every row of ``context``."""
        ...

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        """End of a rollout: the emitted ``completions: [N, T]`` (history drafts index them)."""
        ...

    def update(self, batch: DraftTrainingBatch) -> dict[str, float]:
        """One round of online learning; returns metrics (empty dict for frozen drafts)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer and history: everything a checkpoint must restore."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def not_supported_reasons(self, policy: torch.nn.Module, params: SamplingParams) -> list[str]:
        """Why this draft cannot serve ``policy`` (e.g. a different vocabulary)."""
        ...

    def bind_policy(self, policy: torch.nn.Module) -> None:
        """The sampler's policy module (called by ``Sampler.sync_weights``): drafts that share the
        policy's embedding / lm_head read them from here; others ignore it."""
        ...


@runtime_checkable
class TreeDraftModel(DraftModel, Protocol):
    """A draft that also proposes trees (every built-in draft does; a draft without
    ``propose_tree`` is served with chains)."""

    def propose_tree(
        self, context: DraftContext, budget: TreeBudget, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        """At most ``budget.nodes`` nodes per row (every row the same count ``N``), each row's
        tree of depth <= ``budget.depth`` and width <= ``budget.width``; ``parents`` set."""
        ...


class StatelessDraft:
    """The hooks of a draft with no weights to train and nothing to keep between rollouts: each
    does nothing (a draft overrides the ones it needs)."""

    learnable: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False

    def not_supported_reasons(self, policy: torch.nn.Module, params: SamplingParams) -> list[str]:
        return []

    def bind_policy(self, policy: torch.nn.Module) -> None:
        return None  # nothing shared with the policy

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        return None

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        return None

    def update(self, batch: DraftTrainingBatch) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing changes, nothing to checkpoint

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
