"""Trainer mode ``grpo_parts_sync``: verl's v1 sync trainer with the one filtering buffer
(:class:`~.sampler.FilteringReplayBuffer`) around its own, so the filter runs before
``_compute_old_log_prob``, and prompt skipping before the rollout. ``_compute_advantage`` runs verl's
step, then writes back the full-group advantages the filter stored (verl's estimator would re-normalise
within the kept rows); what would train on anything else is refused at start. docs/adapters/verl.md."""

from __future__ import annotations

import logging
import os
from typing import Any

from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from grpo_parts.doors.skipping import build_skipper
from grpo_parts.errors import NotSupportedError

from .filtering import VERL_KEYS, FilterOptions, skip_reasons
from .kv_filter import check_weighted, restore_group_advantages
from .sampler import FilteringReplayBuffer
from .skipping import VerlSkipStage

logger = logging.getLogger(__name__)

NAME = "grpo_parts_sync"


def filter_options_from(config: Any) -> FilterOptions | None:
    """``config.grpo_parts.filter`` (absent or ``name: null`` = off) -> FilterOptions. The advantage
    normalisation follows ``algorithm.norm_adv_by_std_in_grpo`` unless set explicitly."""
    node = OmegaConf.select(config, "grpo_parts.filter", default=None)
    if node is None:
        return None
    raw = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if not isinstance(raw, dict):
        raise ValueError(f"grpo_parts.filter: expected a mapping of FilterOptions, got {raw!r}")
    opts: dict[str, Any] = {str(k): v for k, v in raw.items()}
    skipping = opts.get("prompt_skip") not in (None, "", "none")
    if not opts or (opts.get("name") in (None, "", "keep_all") and not skipping):
        return None
    if opts.get("name") in (None, ""):  # prompt skipping alone: every rolled-out row is kept
        opts["name"] = "keep_all"
    norm = OmegaConf.select(config, "algorithm.norm_adv_by_std_in_grpo", default=True)
    opts.setdefault("norm_adv_by_std", bool(norm))  # follow verl's setting unless given
    for key, path in VERL_KEYS.items():
        value = OmegaConf.select(config, path, default=None)
        if value is not None:
            opts.setdefault(key, value)
    return FilterOptions(**opts)


def check_algorithm(config: Any) -> None:
    """The filter ranks and trains on GRPO outcome advantages of the full groups: refuse settings
    under which verl would train on something else."""
    reasons = []
    est = OmegaConf.select(config, "algorithm.adv_estimator", default="grpo")
    if est not in ("grpo", "grpo_parts_grpo"):
        reasons.append(f"algorithm.adv_estimator: expected 'grpo' or 'grpo_parts_grpo', got {est!r}")
    if OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False):
        reasons.append("algorithm.use_kl_in_reward: expected False (use actor.use_kl_loss), got True")
    if reasons:
        raise NotSupportedError("grpo_parts filter", reasons)


def build_skip_stage(options: FilterOptions | None, config: Any, fetch: Any) -> VerlSkipStage | None:
    """The prompt skipping stage ``grpo_parts.filter.prompt_skip`` asks for (None: every prompt
    rolled out); what cannot stay unbiased is refused in one line."""
    if options is None:
        return None
    parts = options.parts
    skipper = build_skipper(
        parts.prompt_skip,
        parts.prompt_skip_kwargs,
        door="verl",
        setting="grpo_parts.filter.prompt_skip",
        reasons=lambda: skip_reasons(options, config),
    )
    if skipper is None:
        return None
    n = int(OmegaConf.select(config, "actor_rollout_ref.rollout.n", default=1))
    return VerlSkipStage(skipper, n, fetch)


class GrpoPartsSyncTrainer(PPOTrainerSync):
    """verl's sync v1 trainer + a grpo_parts CompletionFilter before the policy passes, and prompt
    skipping before the rollout (:mod:`.skipping`)."""

    def __init__(self, config: Any):
        self.grpo_parts_filter_options = opts = filter_options_from(config)
        self.grpo_parts_filter = None if opts is None else opts.build()
        if self.grpo_parts_filter is not None:
            check_algorithm(config)
            check_weighted(self.grpo_parts_filter, opts)
        self.grpo_parts_skip = build_skip_stage(opts, config, lambda: self._fetch_one_gen_batch())
        super().__init__(config)

    def _next_train_batch(self, num_prompts: int | None = None) -> Any:
        if self.grpo_parts_skip is None:
            return super()._next_train_batch(num_prompts)
        from verl.utils import tensordict_utils as tu

        batch = self.grpo_parts_skip.take(num_prompts or int(self.config.data.train_batch_size))
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        return batch

    def _step_folder(self) -> str:
        """The checkpoint folder of the current step, as verl's ``_save_checkpoint`` names it."""
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")

    def _save_checkpoint(self) -> None:
        super()._save_checkpoint()
        if self.grpo_parts_skip is not None:
            self.grpo_parts_skip.save(self._step_folder())

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.grpo_parts_skip is not None and self.global_steps > 0:
            resume_path = self.config.trainer.resume_mode == "resume_path"
            folder = str(self.config.trainer.resume_from_path) if resume_path else self._step_folder()
            self.grpo_parts_skip.load(folder)

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        batch = super()._compute_advantage(batch, metrics)  # rollout correction etc. as in verl
        if self.grpo_parts_filter is None:
            return batch
        return restore_group_advantages(batch)

    def _build_replay_buffer(self) -> Any:
        # verl branches on ``trainer_mode == "sync"`` (replay buffer class, refill, checkpoint restore)
        # and sets trainer_mode just before calling this method: this mode *is* the sync trainer
        self.trainer_mode = "sync"
        inner = super()._build_replay_buffer()
        if self.grpo_parts_filter_options is None:
            return inner
        opts, filt, skip = self.grpo_parts_filter_options, self.grpo_parts_filter, self.grpo_parts_skip
        return FilteringReplayBuffer.around(inner, opts, filt, skip)


def register() -> None:
    """Register ``grpo_parts_sync`` with verl's trainer registry (idempotent)."""
    if TRAINER_REGISTRY.get(NAME) is not GrpoPartsSyncTrainer:
        register_trainer(NAME)(GrpoPartsSyncTrainer)
