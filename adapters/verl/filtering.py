"""``+grpo_parts.filter.*``: the filter's options in a verl config (:class:`FilterOptions`), the checks
that say what verl cannot keep unbiased, and the scored batch a filter sees (advantages by
:func:`grpo_parts.core.group_advantages`, groups = ``uid``). verl's ``main_ppo_v0`` has no filter seam."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from grpo_parts import build as parts_build
from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.core.unbiased import Fact, WeightedLossFacts, refusal_reasons
from grpo_parts.errors import GRPOPartsError, check_tensor
from grpo_parts.filter.protocol import CompletionFilter, WeighsLoss
from grpo_parts.filter.rounding import batch_multiple
from grpo_parts.parts_config import DOOR_DEFAULTS, KnownFields, PartsConfig
from grpo_parts.types import ScoredBatch

from .advantage import uid_to_group_index

#: FilterOptions keys read from verl's config (the trainer mode reads them, ``sampler.hydra_overrides``
#: interpolates them): refill granularity, mini-batches and ranks, the actor's loss settings
VERL_KEYS = {
    "refill_multiple": "data.gen_batch_size",
    "train_batch_size": "data.train_batch_size",
    "ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "rollout_n": "actor_rollout_ref.rollout.n",
    "n_gpus_per_node": "trainer.n_gpus_per_node",
    "nnodes": "trainer.nnodes",
    "log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "log_prob_use_dynamic_bsz": "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "ref_log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "ref_log_prob_use_dynamic_bsz": "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
    "loss_scale_factor": "actor_rollout_ref.actor.loss_scale_factor",
    "use_kl_loss": "actor_rollout_ref.actor.use_kl_loss",
    "entropy_coeff": "actor_rollout_ref.actor.entropy_coeff",
    "policy_loss_mode": "actor_rollout_ref.actor.policy_loss.loss_mode",
}


class FilterOptions(KnownFields):
    """``+grpo_parts.filter.*`` in a verl config: a grpo_parts filter (``name``/``kwargs``), its refill
    (``target_rows``, ``refill_rounds``, ``refill_multiple``), the rounding of the kept count
    (``multiple_of``, ``kept_rounding``, the data-parallel keys of :attr:`batch_multiple`), the actor's loss
    settings a weighted filter checks (:func:`weighted_filter_reasons`) and prompt skipping (trainer mode
    ``grpo_parts_sync`` only). :data:`VERL_KEYS` are interpolated from verl's config (the sampler seam does
    not see ``data``). docs/adapters/verl.md, "Switching each part on"."""

    name: str = DOOR_DEFAULTS["verl"]["filter"]
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

    @property
    def parts(self) -> PartsConfig:
        """The filter's settings as the one parts configuration (validated there: names, ranges)."""
        return PartsConfig(
            filter=self.name, filter_kwargs=self.kwargs, refill_rounds=self.refill_rounds,
            kept_rounding=self.kept_rounding, prompt_skip=self.prompt_skip, prompt_skip_kwargs=self.prompt_skip_kwargs,
        )  # fmt: skip

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
        return parts_build.build_filter(
            parts.filter, kwargs=parts.filter_kwargs, where="grpo_parts.filter.kwargs"
        )

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


def _loss_facts(o: FilterOptions, source: str, **kw: Any) -> WeightedLossFacts:
    """The facts of :mod:`grpo_parts.core.unbiased` for ``source`` (and ``kw``): the refill, the actor
    settings under which a weight carried by the advantage does not scale a row's loss, and those whose
    normaliser depends on the draw."""
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
    refill: Fact | None = None
    if o.refill_rounds:
        refill = (f"refill_rounds={o.refill_rounds}", "set grpo_parts_filter.refill_rounds=0")
    return WeightedLossFacts(
        source=source, refill=refill, unscaled=tuple(unscaled), normaliser_from_draw=tuple(normaliser), **kw
    )


def weighted_filter_reasons(filt: Any, options: FilterOptions, needs_step: bool = True) -> list[str]:
    """Why verl cannot train the weighted filter ``filt`` (``dppo``) unbiased under ``options`` (empty
    for a plain filter; docs/filter.md, "Unbiased pruning (`dppo`)"). ``needs_step``: verl pads the kept
    rows, so the mini-batch rows must be known."""
    if not isinstance(filt, WeighsLoss):
        return []
    reasons = refusal_reasons(_loss_facts(options, "dppo"))
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

    reasons = refusal_reasons(_loss_facts(options, "prompt skipping", normaliser="drawn"))
    if config is not None:
        if OmegaConf.select(config, "algorithm.filter_groups.enable", default=False):
            reasons.append("algorithm.filter_groups.enable: verl's DAPO filter re-draws prompts after the skip draw; turn it off")  # fmt: skip
        if OmegaConf.select(config, "trainer.v1.sampler.sync_refill_failed_groups", default=False):
            reasons.append("trainer.v1.sampler.sync_refill_failed_groups: it re-draws prompts after the skip draw; turn it off")  # fmt: skip
    return reasons


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
    gi = uid_to_group_index(uid)[0].to(rewards.device)
    adv = group_advantages(rewards, gi, adv_config or AdvantageConfig())
    lengths = None if response_mask is None else response_mask.long().sum(-1)
    return ScoredBatch(rewards=rewards, advantages=adv, group_index=gi, completion_lengths=lengths)
