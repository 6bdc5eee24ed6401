"""Apply a :class:`FilterResult`: slice the rollout and its per-row tensors to the kept rows, with
the loss denominators that go with them (docs/filter.md, "Loss normalisation for the kept set").

A deterministic filter's kept set is normalised by its own ``num_tokens`` / ``num_seqs``; a filter with
importance weights (``dppo``) by the *whole* batch's, fixed before pruning and counted as the loss counts
them (``apply_filter(..., loss=cfg)``; the rule: :mod:`grpo_parts.core.unbiased`). One round in a loop::

    res = filt.select(ScoredBatch(rewards, advantages, rollout.group_index))
    kb = apply_filter(res, rollout, advantages, loss=cfg)
    if kb.is_empty:
        continue  # nothing to learn from this batch
    ...
    out = grpo_loss(logps, old, kb.advantages, kb.rollout.completion_mask, cfg,
                    num_tokens=kb.num_tokens, num_seqs=kb.num_seqs, seq_weights=kb.weights)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core import LossConfig
from ..errors import GRPOPartsError, check_tensor
from ..types import VISION_KEYS, FilterResult, Rollout, VisionInputs

__all__ = ["KeptBatch", "apply_filter", "loss_denominators", "select_rows"]


def loss_denominators(completion_mask: torch.Tensor, count_empty: bool = False) -> tuple[float, float]:
    """``(num_tokens, num_seqs)`` of a batch, as :func:`grpo_parts.core.aggregate` counts them:
    masked-in tokens, and rows with at least one masked-in token (every row with ``count_empty``,
    ``LossConfig.seq_count="all"``)."""
    m = completion_mask.long()
    rows = m.shape[0] if count_empty else int((m.sum(-1) > 0).sum())
    return float(m.sum()), float(rows)


def _check_kept(kept: torch.Tensor, n: int) -> None:
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= n):
        raise GRPOPartsError(
            f"FilterResult.kept: expected row indices in [0, {n}), got range [{int(kept.min())}, {int(kept.max())}]"
        )


@dataclass(frozen=True)
class KeptBatch:
    """The kept rows (one round: :func:`apply_filter`; several: ``refill.FilledBatch``, a
    subclass). ``rollout`` is None when nothing was kept (then every tensor has 0 rows).
    ``num_tokens`` / ``num_seqs``: the loss denominators to use -- the kept set's own, or the whole
    batch's when the filter gave ``weights`` (``[K]``, None = all 1; see module docstring)."""

    rollout: Rollout | None
    advantages: torch.Tensor  # [K]
    kept: torch.Tensor  # [K] rows of the original batch
    num_tokens: float
    num_seqs: float
    old_logps: torch.Tensor | None = None  # [K, T]
    ref_logps: torch.Tensor | None = None  # [K, T]
    rewards: torch.Tensor | None = None  # [K]
    weights: torch.Tensor | None = None  # [K] importance weights (FilterResult.weights)

    @property
    def is_empty(self) -> bool:
        return self.rollout is None

    @property
    def size(self) -> int:
        return int(self.kept.numel())


def apply_filter(
    result: FilterResult,
    rollout: Rollout,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    loss: LossConfig | None = None,
) -> KeptBatch:
    """Slice ``rollout`` and the per-row tensors (``advantages: [N]`` or ``[N, T]``, ``old_logps``,
    ``ref_logps: [N, T]``, ``rewards: [N]``) to ``result.kept``. ``group_index`` keeps the original
    prompt numbering, so a shared-prefix backend still sees which rows share a prompt. With
    ``result.weights`` the denominators are the whole batch's and the weights come along.
    ``loss``: the config ``grpo_loss`` runs with, so ``num_seqs`` counts rows as it does (needed
    when a weighted result's batch holds a row without a completion token)."""
    n, t = rollout.num_completions, rollout.completion_ids.shape[1]
    check_tensor("advantages", advantages, shape=[n] if advantages.ndim == 1 else [n, t], dtype="float")
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if x is not None:
            check_tensor(name, x, shape=[n, t], dtype="float")
    if rewards is not None:
        check_tensor("rewards", rewards, shape=[n], dtype="float")
    kept = result.kept.to(rollout.completion_ids.device)
    _check_kept(kept, n)

    def take(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[kept]

    weights = None if result.weights is None else result.weights.to(kept.device)
    rows = (take(old_logps), take(ref_logps), take(rewards))
    if result.is_empty:
        return KeptBatch(None, advantages[kept], kept, 0.0, 0.0, *rows, weights=weights)
    sub = rollout.select(kept)
    empty = int((rollout.completion_mask.sum(-1) == 0).sum()) if weights is not None else 0
    if loss is None and empty:
        raise GRPOPartsError(
            f"apply_filter(loss=...): a weighted result's batch has {empty} row(s) without a completion token, "
            "which the full batch's sequence count includes only under LossConfig.seq_count='all'; expected "
            "the LossConfig grpo_loss runs with, got None"
        )
    # the kept set's own denominators; a weighted (unbiased) estimate: the full batch's, fixed before pruning
    counted = sub if weights is None else rollout
    count_empty = loss is not None and loss.seq_count == "all"
    num_tokens, num_seqs = loss_denominators(counted.completion_mask, count_empty)
    return KeptBatch(sub, advantages[kept], kept, num_tokens, num_seqs, *rows, weights=weights)


def select_rows(batch: Mapping[str, Any], kept: torch.Tensor, num_rows: int) -> dict[str, Any]:
    """Slice every per-row entry of a framework's batch dict (TRL's ``inputs``: tensors whose first
    dim is ``num_rows``, or lists of that length) to ``kept``, and its flat image entries to the
    kept rows' images (:meth:`~grpo_parts.types.VisionInputs.per_row`); other entries are passed
    through."""
    _check_kept(kept, num_rows)
    idx = kept.tolist()
    out: dict[str, Any] = {}
    # a processor's flat image entries (pixel_values over the batch's images or patches, a grid per
    # image) do not run over rows: each kept row takes its own images, counted in num_images
    images = VisionInputs.per_row(batch, num_rows)
    flat = images.flat(idx, [k for k in VISION_KEYS if k in batch]) if images is not None else {}
    for key, value in batch.items():  # in the batch's key order (TRL splits by its first tensor)
        if key in flat:
            out[key] = flat[key]
        elif isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == num_rows:
            out[key] = value[kept.to(value.device)]
        elif isinstance(value, (list, tuple)) and len(value) == num_rows:
            out[key] = type(value)(value[i] for i in idx)
        else:
            out[key] = value
    return out
