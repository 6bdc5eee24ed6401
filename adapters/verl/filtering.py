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
from grpo_parts.core.unbiased import Fact, WeightedLossFacts, refusal_reasons
from grpo_parts.errors import GRPOPartsError, NotSupportedError, check_tensor
from grpo_parts.filter.allocation import legacy_refill
from grpo_parts.filter.data_parallel import batch_multiple, round_rounds
from grpo_parts.filter.protocol import WEIGHTED_ROWS, CompletionFilter, WeighsLoss
from grpo_parts.parts_config import PartsConfig
from grpo_parts.types import ScoredBatch

from .advantage import uid_to_group_index


class FilterOptions(BaseModel):
    """``+grpo_parts.filter.*`` in a verl config.

    ``name``/``kwargs``: a grpo_parts filter (``cppo`` with ``{k: 4}`` or ``{pruning_rate: 0.75}``,
    ``zero_variance``, ``pods`` with ``{m: 4}``). ``target_rows``: completions to train on per step
    (None = whatever the filter keeps). ``refill``: roll out more prompts until ``target_rows`` are
    kept, up to ``refill_rounds`` extra rounds (v1 trainer only; 0: no refill; earlier ``refill`` +
    ``max_rounds``, the rounds in all, are read as it, logged). ``refill_multiple`` (else ``train_batch_size``, else 1): round refill
    requests up to a multiple of this -- verl submits prompts in whole fetches of
    ``data.gen_batch_size or data.train_batch_size``, and the sampler seam does not see ``data``, so
    :func:`grpo_parts_adapters.verl.sampler.hydra_overrides` interpolates both.
    ``multiple_of``/``kept_rounding``: make the kept count a multiple of this, ``up`` or ``down``
    (earlier ``rounding`` reads as it). :attr:`parts` is these options as the one
    :class:`~grpo_parts.parts_config.PartsConfig` every door reads (``name`` -> ``filter``, ``kwargs``
    -> ``filter_kwargs``).

    Data parallelism: ``ppo_mini_batch_size`` x ``rollout_n`` (rows per optimizer step) and
    ``n_gpus_per_node`` x ``nnodes`` (the ranks) join ``multiple_of`` in :attr:`batch_multiple`, the
    least common multiple the kept count is rounded to (``hydra_overrides`` interpolates all four
    from verl's config), so verl's ``_balance_batch`` cuts it into equal per-rank shares of whole
    mini-batches and adds no padding rows. Without token balancing (``*_use_dynamic_bsz``), each rank's
    old-policy and reference log-prob passes cut its rows into ``*_log_prob_micro_batch_size_per_gpu``
    micro-batches, which verl asserts divide them: those x the ranks join the multiple too. ``target_rows``
    must be a multiple of it.

    ``loss_agg_mode``, ``loss_scale_factor``, ``use_kl_loss``, ``entropy_coeff``, ``policy_loss_mode``:
    the actor's loss settings (verl's defaults; ``hydra_overrides`` and the trainer mode read verl's
    own), which a weighted filter (``dppo``) checks: :func:`weighted_filter_reasons`.

    ``prompt_skip`` / ``prompt_skip_kwargs``: a prompt skipper before rollout (``history``; trainer
    mode ``grpo_parts_sync`` only, :mod:`.skipping`), checked by :func:`skip_reasons`; with no
    ``name`` the filter is ``keep_all``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "cppo"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    target_rows: int | None = Field(None, ge=1)
    refill_rounds: int = Field(0, ge=0)
    refill_multiple: int | None = Field(None, ge=1)
    train_batch_size: int | None = Field(None, ge=1)
    multiple_of: int = Field(1, ge=1)
    kept_rounding: Literal["up", "down"] = "up"
    norm_adv_by_std: bool = True
    ppo_mini_batch_size: int | None = Field(None, ge=1)
    rollout_n: int | None = Field(None, ge=1)
    n_gpus_per_node: int | None = Field(None, ge=1)
    nnodes: int = Field(1, ge=1)
    #: the old-policy / reference log-prob passes split each rank's kept rows into micro-batches of
    #: this size (verl asserts they divide) unless they balance by tokens (``*_use_dynamic_bsz``)
    log_prob_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    log_prob_use_dynamic_bsz: bool = False
    ref_log_prob_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    ref_log_prob_use_dynamic_bsz: bool = False
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    use_kl_loss: bool = False
    entropy_coeff: float = 0.0
    policy_loss_mode: str = "vanilla"
    prompt_skip: str = "none"
    prompt_skip_kwargs: dict[str, Any] = Field(default_factory=dict)

    @property
    def batch_multiple(self) -> int:
        """What the kept count is rounded to (see the class docstring)."""
        step = None if self.ppo_mini_batch_size is None else self.ppo_mini_batch_size * (self.rollout_n or 1)
        world = None if self.n_gpus_per_node is None else self.n_gpus_per_node * self.nnodes
        micro = [
            None if dynamic or size is None else size * (world or 1)
            for size, dynamic in (
                (self.log_prob_micro_batch_size_per_gpu, self.log_prob_use_dynamic_bsz),
                (self.ref_log_prob_micro_batch_size_per_gpu, self.ref_log_prob_use_dynamic_bsz),
            )
        ]
        return batch_multiple(self.multiple_of, step, world, *micro)

    @model_validator(mode="before")
    @classmethod
    def _one_refill_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rounding" in data:
            if "kept_rounding" in data:
                raise ValueError("give kept_rounding only (rounding is its earlier name)")
            data = {**data, "kept_rounding": data["rounding"]}
            del data["rounding"]
        return legacy_refill(data, "max_rounds", counts_first_round=True, where="grpo_parts_filter")

    @property
    def parts(self) -> PartsConfig:
        """These options as the one parts configuration (validated there: names, ranges)."""
        return PartsConfig.for_door(
            "verl",
            {
                "filter": self.name,
                "filter_kwargs": self.kwargs,
                "refill_rounds": self.refill_rounds,
                "kept_rounding": self.kept_rounding,
                "prompt_skip": self.prompt_skip,
                "prompt_skip_kwargs": self.prompt_skip_kwargs,
            },
        )

    @model_validator(mode="after")
    def _target_fits(self) -> FilterOptions:
        m = self.batch_multiple
        if self.target_rows is not None and self.target_rows % m:
            raise ValueError(
                f"target_rows: expected a multiple of {m} (lcm of multiple_of, ppo_mini_batch_size x "
                f"rollout_n, the ranks, and the log-prob micro-batches x the ranks), got {self.target_rows}"
            )
        return self

    @property
    def refill_granularity(self) -> int:
        return self.refill_multiple or self.train_batch_size or 1

    def build(self) -> CompletionFilter:
        parts = self.parts
        return build_filter(parts.filter, parts.filter_kwargs)

    @property
    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(norm="group" if self.norm_adv_by_std else "none", eps=1e-6)


#: verl policy losses that are positively homogeneous in the advantage (a weight carried by the
#: advantage scales the row's whole loss term): ``vanilla`` (PPO clip, dual clip), ``gspo``, ``gpg``
HOMOGENEOUS_POLICY_LOSSES = ("vanilla", "gspo", "gpg")
#: verl aggregations whose per-mini-batch normaliser is fixed (``global_batch_size`` = ppo mini-batch
#: rows, or none), so that folding ``padded kept rows / rolled-out rows`` into the weights restores the
#: full batch's normaliser; ``token-mean`` divides by the kept rows' own tokens (``batch_num_tokens``)
FIXED_NORMALISER_AGGS = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


def _loss_facts(o: FilterOptions) -> tuple[list[Fact], list[Fact]]:
    """``(unscaled, normaliser_from_draw)``: the actor settings under which a weight carried by the
    advantage does not scale a row's loss, and those whose normaliser depends on the draw."""
    use = "use seq-mean-token-mean (set it in actor_rollout_ref.actor and in grpo_parts_filter.loss_agg_mode)"
    normaliser: list[Fact] = []
    if o.loss_agg_mode not in FIXED_NORMALISER_AGGS:
        normaliser.append((f"actor.loss_agg_mode={o.loss_agg_mode!r}", f"verl divides each mini-batch by its own kept tokens; {use}"))  # fmt: skip
    if o.loss_agg_mode == "seq-mean-token-sum-norm" and o.loss_scale_factor is None:
        normaliser.append(("seq-mean-token-sum-norm without actor.loss_scale_factor", "its default is each micro-batch's padded width; set loss_scale_factor"))  # fmt: skip
    unscaled: list[Fact] = []
    if o.use_kl_loss:
        unscaled.append(
            ("actor.use_kl_loss=True", "put the KL in the reward (algorithm.use_kl_in_reward) or drop it")
        )
    if o.entropy_coeff:
        unscaled.append((f"actor.entropy_coeff={o.entropy_coeff}", "set it to 0"))
    if o.policy_loss_mode not in HOMOGENEOUS_POLICY_LOSSES:
        unscaled.append((f"actor.policy_loss.loss_mode={o.policy_loss_mode!r}", f"a weight on the advantage scales the row's loss only for {list(HOMOGENEOUS_POLICY_LOSSES)}"))  # fmt: skip
    return unscaled, normaliser


def _refill_fact(o: FilterOptions) -> Fact | None:
    return (
        (f"refill_rounds={o.refill_rounds}", "set grpo_parts_filter.refill_rounds=0")
        if o.refill_rounds
        else None
    )


def weighted_filter_reasons(filt: Any, options: FilterOptions, needs_step: bool = True) -> list[str]:
    """Why verl cannot train the weighted filter ``filt`` (``dppo``) unbiased under ``options``
    (empty for a plain filter). The adapter multiplies each kept row's advantage by its ``1 / p``
    weight times ``padded kept rows / rolled-out rows`` (see :func:`weighted_advantages`);
    ``needs_step``: the padding is verl's, so the mini-batch rows must be known."""
    if not isinstance(filt, WeighsLoss):
        return []
    unscaled, normaliser = _loss_facts(options)
    facts = WeightedLossFacts(
        source="dppo",
        refill=_refill_fact(options),
        unscaled=tuple(unscaled),
        normaliser_from_draw=tuple(normaliser),
    )
    reasons = refusal_reasons(facts)
    if needs_step and options.ppo_mini_batch_size is None:
        reasons.append(
            "ppo_mini_batch_size / rollout_n not given: the weights fold in the padded kept rows verl "
            "normalises by; hydra_overrides interpolates them"
        )
    return reasons


def skip_reasons(options: FilterOptions, config: Any = None) -> list[str]:
    """Why verl cannot skip prompts with ``1 / p`` weights unbiased under ``options`` (the rule of
    :mod:`grpo_parts.core.unbiased` on the actor's loss settings), plus, from verl's ``config``, the
    settings that re-draw prompts after the skip draw (DAPO's ``filter_groups``, failed-group refill)."""
    from omegaconf import OmegaConf

    unscaled, normaliser = _loss_facts(options)
    facts = WeightedLossFacts(
        source="prompt skipping",
        normaliser="drawn",
        refill=_refill_fact(options),
        unscaled=tuple(unscaled),
        normaliser_from_draw=tuple(normaliser),
    )
    reasons = refusal_reasons(facts)
    if config is not None:
        if OmegaConf.select(config, "algorithm.filter_groups.enable", default=False):
            reasons.append("algorithm.filter_groups.enable: verl's DAPO filter re-draws prompts after the skip draw; turn it off")  # fmt: skip
        if OmegaConf.select(config, "trainer.v1.sampler.sync_refill_failed_groups", default=False):
            reasons.append("trainer.v1.sampler.sync_refill_failed_groups: it re-draws prompts after the skip draw; turn it off")  # fmt: skip
    return reasons


def weighted_advantages(
    scored: ScoredBatch, kept: torch.Tensor, weights: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, float]:
    """``[N]``: the advantage of each kept row times its weight times ``c = K' / N`` (``K'``: the
    kept count padded up to ``multiple`` by verl's no-op rows, ``N``: rows rolled out), 0 for the
    others; and ``c``. verl normalises each mini-batch by its fixed row count, so over the batch the
    weighted loss is the full batch's divided by ``N`` in expectation, step for step."""
    n, k = scored.size, int(kept.numel())
    c = (-(-k // multiple) * multiple) / n if n else 0.0
    out = torch.zeros(n, dtype=torch.float64)
    idx = kept.cpu()
    out[idx] = scored.advantages.detach().cpu().double()[idx] * weights.detach().cpu().double() * c
    return out, c


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
    """Rows kept (ascending, int64) and diagnostics for verl's metrics dict. ``advantages``: with a
    weighted filter, every row's advantage to train on (:func:`weighted_advantages`; rows the
    rounding re-added: 0), else None (the GRPO advantages as they are)."""

    kept: torch.Tensor
    extra_prompts_wanted: int
    metrics: dict[str, float] = field(default_factory=dict)
    advantages: torch.Tensor | None = None


def select(
    scored: ScoredBatch,
    filt: CompletionFilter,
    target_rows: int | None = None,
    multiple_of: int = 1,
    rounding: Literal["up", "down"] = "up",
) -> Selection:
    """Run ``filt`` and round the kept count; metrics are prefixed ``parts/filter/``. A weighted
    draw is rounded up only (the re-added rows train with weight 0; dropping drawn rows would bias it)."""
    res = filt.select(scored, target_size=target_rows)
    kept = round_kept(res.kept, scored, multiple_of, "up" if res.weights is not None else rounding)
    n = scored.size
    adv = None
    if res.weights is not None:
        if not bool(torch.isin(res.kept.cpu(), kept.cpu()).all()):
            raise GRPOPartsError(
                f"multiple_of={multiple_of}: rounding would drop rows of a weighted draw ({n} rows rolled out); "
                "expected a batch of at least one multiple"
            )
        w = torch.zeros(n, dtype=torch.float64)
        w[res.kept.cpu()] = res.weights.detach().cpu().double()
        adv, _ = weighted_advantages(scored, kept, w[kept.cpu()], 1)
    metrics = {
        "parts/filter/rows_in": float(n),
        "parts/filter/rows_kept": float(kept.numel()),
        "parts/filter/kept_fraction": float(kept.numel()) / n if n else 0.0,
        "parts/filter/extra_prompts_wanted": float(res.extra_prompts_wanted),
    }
    if res.weights is not None:
        metrics[f"parts/filter/{WEIGHTED_ROWS}"] = float(res.kept.numel())
    return Selection(kept, res.extra_prompts_wanted, metrics, adv)


def filter_data_proto(
    data: Any,
    filt: CompletionFilter,
    *,
    target_rows: int | None = None,
    multiple_of: int = 1,
    rounding: Literal["up", "down"] = "up",
    reward_key: str = "token_level_rewards",
    adv_config: AdvantageConfig | None = None,
    options: FilterOptions | None = None,
) -> tuple[Any, Selection]:
    """Legacy loop (``main_ppo_v0``): filter a ``DataProto`` right after rewards, before the
    old-policy / reference forwards, with ``DataProto.select_idxs``. Every tensor and non-tensor
    key keeps its trailing shape and ``uid`` its values.

    The kept rows get ``advantages`` and ``returns`` ([B, T], the GRPO advantage of the *full*
    group times ``response_mask``), as CPPO prescribes: do not call verl's ``compute_advantage``
    afterwards -- it would re-normalise inside the kept rows of each group (a group with one kept
    row would get advantage 0, or ``r / (1 + eps)`` in verl).

    A weighted filter (``dppo``) is checked against ``options`` (the actor's loss settings, default
    verl's: refused with ``token-mean``) and its kept rows get ``A * w * K / N``
    (:func:`weighted_advantages`; ``multiple_of`` should be verl's mini-batch rows)."""
    reasons = weighted_filter_reasons(filt, options or FilterOptions(), needs_step=False)
    if reasons:
        raise NotSupportedError(f"grpo_parts filter {getattr(filt, 'name', type(filt).__name__)!r}", reasons)
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
    train_adv = scored.advantages if sel.advantages is None else sel.advantages.to(scored.advantages.device)
    seq_adv = train_adv[sel.kept.to(train_adv.device)]
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
