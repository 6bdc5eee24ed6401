"""Which kept rows each optimizer step of a rollout batch trains on, and with which loss denominators:
whole groups each (shared-prefix attention needs a prompt's rows together); a weighted filter's
minibatches are cut before the draw and normalised by all their rolled-out rows (docs/training.md,
"The step")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...core.unbiased import WeightedLossFacts, refusal_reasons
from ...filter.protocol import WeighsLoss
from ...filter.refill import FilledBatch
from ..config import TrainConfig

__all__ = ["Minibatch", "split_minibatches", "split_groups", "weighted_filter_reasons"]


def split_groups(group_index: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Row indices split into ``parts`` minibatches of whole groups (shared-prefix needs whole groups)."""
    groups = torch.unique(group_index)
    split = torch.tensor_split(groups, min(parts, groups.numel()))
    return [torch.isin(group_index, c).nonzero().squeeze(-1) for c in split if c.numel()]


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step: ``rows`` of the kept batch, their importance ``weights`` and the loss
    denominators (None: ``grpo_parts.core.grpo_loss`` counts the minibatch's own rows)."""

    rows: torch.Tensor
    weights: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None


def split_minibatches(
    filled: FilledBatch[Any], minibatches: int, count_empty: bool = False
) -> list[Minibatch]:
    """The optimizer steps of ``filled`` (not empty), see the module docstring. ``count_empty``:
    the loss counts rows without a completion token as sequences (``LossConfig.seq_count="all"``)."""
    ro = filled.rollout
    assert ro is not None
    if filled.weights is None:
        return [Minibatch(rows) for rows in split_groups(ro.group_index, minibatches)]
    assert filled.full_group is not None and filled.group_tokens is not None
    seqs = filled.group_rows if count_empty else filled.group_seqs
    assert seqs is not None
    full_group = filled.full_group.cpu()
    n_groups = int(filled.group_tokens.numel())
    out = []
    for groups in torch.tensor_split(torch.arange(n_groups), min(minibatches, n_groups)):
        rows = torch.isin(full_group, groups).nonzero().squeeze(-1)
        if rows.numel():
            w = filled.weights[rows.to(filled.weights.device)]
            tokens, n_seqs = float(filled.group_tokens[groups].sum()), float(seqs[groups].sum())
            out.append(Minibatch(rows.to(ro.group_index.device), w, tokens, n_seqs))
    return out


def weighted_filter_reasons(filt: Any, config: TrainConfig) -> list[str]:
    """Why ``grpo-parts train`` cannot train ``config`` unbiased with the weighted filter ``filt``
    (empty for a plain filter): the filter's own loss check, and refill (refused: a refill round
    and its trim depend on the random draw)."""
    if not isinstance(filt, WeighsLoss):
        return []
    reasons = list(filt.loss_not_supported_reasons(config.loss))
    if config.parts.refill_rounds:
        fix = "set parts.refill_rounds=0 and size prompts_per_step for the kept rows you want"
        reasons += refusal_reasons(
            WeightedLossFacts(
                source=getattr(filt, "name", "a weighted filter"),
                refill=(f"parts.refill_rounds={config.parts.refill_rounds}", fix),
            )
        )
    return reasons
