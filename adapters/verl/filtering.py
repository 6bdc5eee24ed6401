"""CompletionFilter on verl batches: the legacy ``DataProto`` loop and the v1 TransferQueue loop.

Both compute GRPO advantages with :func:`grpo_parts.core.group_advantages` (groups = ``uid``), hand a
:class:`~grpo_parts.types.ScoredBatch` to any grpo_parts filter (``cppo``, ``zero_variance`` (DAPO),
``pods``, ...) chosen by name, and keep the selected rows. Nothing here re-ranks rows itself: the
only row choice made on this side is rounding the kept count to a multiple verl needs (mini-batch
or data-parallel size), which re-adds the best pruned rows (or drops the worst kept ones) in the
filter-independent priority order of :mod:`grpo_parts.filter._common`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo_parts import build as parts_build
from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.errors import GRPOPartsError, check_tensor
from grpo_parts.filter.data_parallel import batch_multiple, round_rounds
from grpo_parts.filter.protocol import CompletionFilter
from grpo_parts.types import ScoredBatch

from .advantage import uid_to_group_index


class FilterOptions(BaseModel):
    """``+grpo_parts.filter.*`` in a verl config.

    ``name``/``kwargs``: a grpo_parts filter (``cppo`` with ``{k: 4}`` or ``{pruning_rate: 0.75}``,
    ``zero_variance``, ``pods`` with ``{m: 4}``). ``target_rows``: completions to train on per step
    (None = whatever the filter keeps). ``refill``: roll out more prompts until ``target_rows`` are
    kept (v1 trainer only). ``refill_multiple`` (else ``train_batch_size``, else 1): round refill
    requests up to a multiple of this -- verl submits prompts in whole fetches of
    ``data.gen_batch_size or data.train_batch_size``, and the sampler seam does not see ``data``, so
    :func:`grpo_parts_adapters.verl.sampler.hydra_overrides` interpolates both.
    ``multiple_of``/``rounding``: make the kept count a multiple of this.

    Data parallelism: ``ppo_mini_batch_size`` x ``rollout_n`` (rows per optimizer step) and
    ``n_gpus_per_node`` x ``nnodes`` (the ranks) join ``multiple_of`` in :attr:`batch_multiple`, the
    least common multiple the kept count is rounded to (``hydra_overrides`` interpolates all four
    from verl's config), so verl's ``_balance_batch`` cuts it into equal per-rank shares of whole
    mini-batches and adds no padding rows. ``target_rows`` must be a multiple of it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "cppo"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    target_rows: int | None = Field(None, ge=1)
    refill: bool = False
    max_rounds: int = Field(4, ge=1)
    refill_multiple: int | None = Field(None, ge=1)
    train_batch_size: int | None = Field(None, ge=1)
    multiple_of: int = Field(1, ge=1)
    rounding: Literal["up", "down"] = "up"
    norm_adv_by_std: bool = True
    ppo_mini_batch_size: int | None = Field(None, ge=1)
    rollout_n: int | None = Field(None, ge=1)
    n_gpus_per_node: int | None = Field(None, ge=1)
    nnodes: int = Field(1, ge=1)

    @property
    def batch_multiple(self) -> int:
        """What the kept count is rounded to (see the class docstring)."""
        step = None if self.ppo_mini_batch_size is None else self.ppo_mini_batch_size * (self.rollout_n or 1)
        world = None if self.n_gpus_per_node is None else self.n_gpus_per_node * self.nnodes
        return batch_multiple(self.multiple_of, step, world)

    @model_validator(mode="after")
    def _target_fits(self) -> FilterOptions:
        m = self.batch_multiple
        if self.target_rows is not None and self.target_rows % m:
            raise ValueError(
                f"target_rows: expected a multiple of {m} (lcm of multiple_of, ppo_mini_batch_size x "
                f"rollout_n and the ranks), got {self.target_rows}"
            )
        return self

    @property
    def refill_granularity(self) -> int:
        return self.refill_multiple or self.train_batch_size or 1

    def build(self) -> CompletionFilter:
        return build_filter(self.name, self.kwargs)

    @property
    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(norm="group" if self.norm_adv_by_std else "none", eps=1e-6)


def build_filter(name: str, kwargs: Mapping[str, Any] | None = None) -> CompletionFilter:
    """The grpo_parts filter registered as ``name``, by :func:`grpo_parts.build.build_filter`."""
    return parts_build.build_filter(name, kwargs=kwargs, where="grpo_parts.filter.kwargs")


def scored_batch(
    rewards: torch.Tensor,
    uid: Sequence[Any] | np.ndarray,
    response_mask: torch.Tensor | None = None,
    adv_config: AdvantageConfig | None = None,
) -> ScoredBatch:
    """``rewards: [B]`` (one per completion), ``uid: [B]`` -> ScoredBatch with GRPO advantages."""
    check_tensor("rewards", rewards, ndim=1, dtype="float")
    if len(uid) != rewards.shape[0]:
        raise GRPOPartsError(f"uid: expected {rewards.shape[0]} entries (one per row), got {len(uid)}")
    gi, _ = uid_to_group_index(uid)
    gi = gi.to(rewards.device)
    adv = group_advantages(rewards, gi, adv_config or AdvantageConfig())
    lengths = None if response_mask is None else response_mask.long().sum(-1)
    return ScoredBatch(rewards=rewards, advantages=adv, group_index=gi, completion_lengths=lengths)


def round_kept(
    kept: torch.Tensor,
    scored: ScoredBatch,
    multiple_of: int,
    rounding: Literal["up", "down"] = "up",
    field: str = "multiple_of",
) -> torch.Tensor:
    """Make ``len(kept)`` a multiple of ``multiple_of`` (ascending rows out); ``"up"`` falls back to
    ``"down"`` when the batch has too few rows
    (:func:`grpo_parts.filter.data_parallel.round_rounds`)."""
    return round_rounds([scored], [kept], multiple_of, rounding, field)[0]


@dataclass(frozen=True)
class Selection:
    """Rows kept (ascending, int64) and diagnostics for verl's metrics dict."""

    kept: torch.Tensor
    extra_prompts_wanted: int
    metrics: dict[str, float] = field(default_factory=dict)


def select(
    scored: ScoredBatch,
    filt: CompletionFilter,
    target_rows: int | None = None,
    multiple_of: int = 1,
    rounding: Literal["up", "down"] = "up",
) -> Selection:
    """Run ``filt`` and round the kept count; metrics are prefixed ``grpo_parts/filter/``."""
    res = filt.select(scored, target_size=target_rows)
    kept = round_kept(res.kept, scored, multiple_of, rounding)
    n = scored.size
    metrics = {
        "grpo_parts/filter/rows_in": float(n),
        "grpo_parts/filter/rows_kept": float(kept.numel()),
        "grpo_parts/filter/kept_fraction": float(kept.numel()) / n if n else 0.0,
        "grpo_parts/filter/extra_prompts_wanted": float(res.extra_prompts_wanted),
    }
    return Selection(kept, res.extra_prompts_wanted, metrics)


def filter_data_proto(
    data: Any,
    filt: CompletionFilter,
    *,
    target_rows: int | None = None,
    multiple_of: int = 1,
    rounding: Literal["up", "down"] = "up",
    reward_key: str = "token_level_rewards",
    adv_config: AdvantageConfig | None = None,
) -> tuple[Any, Selection]:
    """Legacy loop (``main_ppo_v0``): filter a ``DataProto`` right after rewards, before the
    old-policy / reference forwards, with ``DataProto.select_idxs``. Every tensor and non-tensor
    key keeps its trailing shape and ``uid`` its values.

    The kept rows get ``advantages`` and ``returns`` ([B, T], the GRPO advantage of the *full*
    group times ``response_mask``), as CPPO prescribes: do not call verl's ``compute_advantage``
    afterwards -- it would re-normalise inside the kept rows of each group (a group with one kept
    row would get advantage 0, or ``r / (1 + eps)`` in verl)."""
    if data.batch is None or reward_key not in data.batch.keys():
        got = [] if data.batch is None else sorted(data.batch.keys())
        raise GRPOPartsError(f"data.batch[{reward_key!r}]: expected per-token rewards [B, T], got keys {got}")
    if "uid" not in data.non_tensor_batch:
        raise GRPOPartsError(
            f"data.non_tensor_batch['uid']: expected one group id per row, got keys {sorted(data.non_tensor_batch)}"
        )
    mask = data.batch["response_mask"] if "response_mask" in data.batch.keys() else None
    rewards = data.batch[reward_key].sum(-1)
    scored = scored_batch(rewards, data.non_tensor_batch["uid"], mask, adv_config)
    sel = select(scored, filt, target_rows, multiple_of, rounding)
    if sel.kept.numel() == 0:
        raise GRPOPartsError(
            "filter: kept 0 rows (every group has all-equal rewards?); skip this step or refill before updating"
        )
    kept = data.select_idxs(sel.kept.cpu().numpy())
    seq_adv = scored.advantages[sel.kept.to(scored.advantages.device)]
    tok_mask = kept.batch["response_mask"] if mask is not None else torch.ones_like(kept.batch[reward_key])
    adv = seq_adv.to(kept.batch[reward_key].dtype).unsqueeze(-1) * tok_mask.to(kept.batch[reward_key].dtype)
    kept.batch["advantages"] = adv
    kept.batch["returns"] = adv.clone()
    return kept, sel


# ------------------------------------------------------------------------------ v1 (TransferQueue)

#: Fields the v1 filter reads from TransferQueue.
KV_FIELDS = ("uid", "rm_scores", "response_mask")
#: Per-row field the v1 filter writes: the GRPO advantage of the row within its *full* group.
SEQ_ADV_FIELD = "grpo_parts_seq_advantage"


def rewards_from_fields(fields: Any) -> tuple[torch.Tensor, list[Any], torch.Tensor]:
    """TransferQueue fields (nested or padded) -> ``rewards [B]``, ``uid``, ``response_mask [B, T]``."""
    td = fields.to_padded_tensor() if hasattr(fields, "to_padded_tensor") else fields
    scores, mask = td["rm_scores"], td["response_mask"]
    uid = td["uid"]
    uid = uid.tolist() if hasattr(uid, "tolist") else list(uid)
    return scores.float().sum(-1), uid, mask
