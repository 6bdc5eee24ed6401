"""Trainer mode ``grpo_parts_sync``: verl's v1 sync trainer with a grpo_parts filter (and refill)
between sampling and the old-policy / reference / actor passes.

Enable with ``trainer.use_v1=True trainer.v1.trainer_mode=grpo_parts_sync +grpo_parts.filter.name=cppo
+grpo_parts.filter.kwargs.k=8`` (see docs/adapters/verl.md). The trainer wraps its replay buffer so
that ``sample`` returns only the kept rows: pruning happens *before* ``_compute_old_log_prob``, so the
old-policy, reference and actor passes run on the kept rows only, and dropped rows are cleared
from TransferQueue. With ``refill_rounds > 0`` it asks the rollout for ``extra_prompts_wanted`` more prompts
(``_add_prompts_to_generate``) and samples again, still inside the sampling phase (the rollout
replicas are awake), until ``target_rows`` rows are kept or ``refill_rounds`` extra rounds ran
(:class:`grpo_parts.filter.allocation.Refiller`). Rewards must be known at sampling time (rule-based
reward or ``reward.reward_model.enable_resource_pool=True``), exactly as for verl's DAPO filter.

Advantages: the filter ranks rows by their GRPO advantage within the *full* group and stores it per
kept row; ``_compute_advantage`` runs verl's own step (rollout correction, metrics) and then
writes those full-group advantages back, because verl's estimator, seeing only the kept rows,
would re-normalise inside them (CPPO trains on the full-group advantages). Settings under which
verl would train on anything else (a non-GRPO estimator, KL in the reward) are refused at start.

Prompt skipping (``+grpo_parts.filter.prompt_skip=history``, :mod:`.skipping`): the mode's
``_next_train_batch`` draws each step's prompts past the skipper before they are submitted, the
filter step multiplies each kept row's stored advantage by its prompt's weight and tells the
skipper every rolled-out group, and the skipper's history is saved beside verl's checkpoint.

This module imports verl (and TransferQueue) at import time; the plugin imports it only when verl's
v1 trainer is importable.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from grpo_parts.filter.allocation import Refiller, Round
from grpo_parts.filter.data_parallel import round_rounds
from grpo_parts.filter.protocol import WEIGHTED_ROWS, CompletionFilter

from .filtering import (
    KV_FIELDS,
    SEQ_ADV_FIELD,
    FilterOptions,
    rewards_from_fields,
    scored_batch,
    skip_reasons,
    weighted_advantages,
    weighted_filter_reasons,
)
from .skipping import VerlSkipStage

logger = logging.getLogger(__name__)

NAME = "grpo_parts_sync"
#: FilterOptions keys read from verl's config (the trainer mode; ``sampler.hydra_overrides`` interpolates them)
ACTOR_KEYS = {
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
    # whole mini-batches on every rank (FilterOptions.batch_multiple), and the actor's loss settings
    # a weighted filter checks, from verl's own keys
    for key, path in ACTOR_KEYS.items():
        value = OmegaConf.select(config, path, default=None)
        if value is not None:
            opts.setdefault(key, value)
    return FilterOptions(**opts)


def check_algorithm(config: Any) -> None:
    """The filter ranks and trains on GRPO outcome advantages of the full groups: refuse settings
    under which verl would train on something else."""
    from grpo_parts.errors import NotSupportedError

    reasons = []
    est = OmegaConf.select(config, "algorithm.adv_estimator", default="grpo")
    if est not in ("grpo", "grpo_parts_grpo"):
        reasons.append(f"algorithm.adv_estimator: expected 'grpo' or 'grpo_parts_grpo', got {est!r}")
    if OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False):
        reasons.append("algorithm.use_kl_in_reward: expected False (use actor.use_kl_loss), got True")
    if reasons:
        raise NotSupportedError("grpo_parts filter", reasons)


def check_weighted(filt: CompletionFilter, options: FilterOptions | None) -> None:
    """Refuse, in one line, a weighted filter (``dppo``) under settings verl cannot keep unbiased."""
    from grpo_parts.errors import NotSupportedError

    reasons = weighted_filter_reasons(filt, options) if options is not None else []
    if reasons:
        raise NotSupportedError(
            f"grpo_parts filter {options.name!r}" if options else "grpo_parts filter", reasons
        )


def _kept_by_round(outcome: Any, options: FilterOptions) -> dict[int, set[int]]:
    """Kept row indices per round's payload (by ``id``), rounded so that the total over all rounds
    fills whole mini-batches on every rank (no padding rows). A weighted draw is not rounded (that
    would re-rank its rows): verl pads it with no-op rows, which :func:`weighted_advantages` counts."""
    if any(sel.weights is not None for sel in outcome.selections):
        return {id(sel.round.payload): set(sel.kept.tolist()) for sel in outcome.selections}
    rounded = round_rounds(
        [sel.round.scored for sel in outcome.selections],
        [sel.kept for sel in outcome.selections],
        options.batch_multiple,
        options.kept_rounding,
        field="grpo_parts_filter.multiple_of",
    )
    return {id(sel.round.payload): set(rows.tolist()) for sel, rows in zip(outcome.selections, rounded)}


def _filter_metrics(
    outcome: Any, weighted: list[Any], kept: int, target: int, empty: bool, scores: list[torch.Tensor]
) -> dict[str, float]:
    metrics = {f"parts/filter/{k}": float(v) for k, v in outcome.info.items()}
    if scores:  # every rolled-out row's reward: verl's own critic/score is over the kept rows
        metrics["parts/filter/score_mean_rolled_out"] = float(torch.cat(scores).mean())
    if weighted:  # the rows trained with a weight (dppo)
        metrics[f"parts/filter/{WEIGHTED_ROWS}"] = float(sum(sel.kept.numel() for sel in weighted))
    metrics["parts/filter/rows_kept"] = float(kept)
    metrics["parts/filter/empty_batch_steps"] = float(empty)
    metrics["parts/filter/target_rows"] = float(target)
    return metrics


def _keep_something(
    kept: dict[int, set[int]], rounds: list[KVBatchMeta], outcome: Any, options: FilterOptions
) -> bool:
    """verl cannot train an empty batch (its balancer asserts): when the filter keeps nothing --
    every group zero-variance, so every advantage is 0 -- keep the first whole mini-batch of rows
    (zero advantage: the update moves nothing a full batch would not). Returns whether it did."""
    if any(kept.values()) or not rounds or any(sel.weights is not None for sel in outcome.selections):
        return False
    n = min(len(rounds[0].keys), max(1, options.batch_multiple))
    kept[id(rounds[0])] = set(range(n))
    logger.warning("grpo_parts filter kept no row (all advantages 0); training %d zero-advantage rows", n)
    return True


def _store_kept(b: KVBatchMeta, kept: set[int], advantages: torch.Tensor | None, store: Any) -> list[int]:
    """Clear ``b``'s dropped rows from ``store`` and put the full-group advantages of its kept rows
    (restored after verl's ``_compute_advantage``, see the trainer); returns the kept rows, sorted."""
    dropped = [k for i, k in enumerate(b.keys) if i not in kept]
    if dropped:
        store.kv_clear(keys=dropped, partition_id=b.partition_id)
    kept_rows = sorted(kept)
    if kept_rows:
        assert advantages is not None
        adv = advantages[torch.tensor(kept_rows)].float()
        fields = TensorDict({SEQ_ADV_FIELD: adv}, batch_size=[len(kept_rows)])
        store.kv_batch_put(keys=[b.keys[i] for i in kept_rows], partition_id=b.partition_id, fields=fields)
    return kept_rows


def _full_groups(
    scored: Any, uid: list[Any], kept_rows: list[int], advantages: torch.Tensor, weighted: bool
) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """``{uid: (rewards, advantages)}`` of the full group of every uid with a kept row; with a
    weighted draw (``advantages`` weighted, 0 off the draw) of its kept rows only -- rows of one
    group with equal rewards have equal weights, so the estimator's lookup by reward is exact."""
    groups = {}
    for g in dict.fromkeys(uid[i] for i in kept_rows):
        rows = torch.tensor([j for j in (kept_rows if weighted else range(len(uid))) if uid[j] == g])
        groups[g] = (scored.rewards[rows].detach().cpu(), advantages[rows].detach().cpu())
    return groups


def _train_advantages(sel: Any, options: FilterOptions) -> tuple[torch.Tensor, Any]:
    """``(advantages to train on [N], scored)`` of one selection: the GRPO advantages, or for a
    weighted draw each kept row's advantage x weight x padded kept / rolled-out rows."""
    scored = sel.round.scored
    if sel.weights is None:
        return scored.advantages, scored
    return weighted_advantages(scored, sel.kept, sel.weights, options.batch_multiple)[0], scored


def _refiller(batch: KVBatchMeta, target: int, options: FilterOptions, more: Any) -> Refiller:
    return Refiller(
        target_size=target,
        initial_prompts=max(1, len({t.get("uid", k) for k, t in zip(batch.keys, batch.tags)})),
        max_rounds=1 + (options.refill_rounds if more is not None else 0),
    )


def _round_advantages(
    b: KVBatchMeta, train_adv: dict[int, Any], empty: bool, skip: VerlSkipStage | None, uid: list[Any]
) -> tuple[torch.Tensor | None, Any]:
    """``(advantages [N] or None, scored)`` round ``b`` stores for its kept rows: the filter's, the
    kept-nothing fallback's zeros, times each row's prompt-skip weight (``1 / p x rolled-out / drawn``)."""
    adv, sc = train_adv.get(id(b), (None, None))
    if adv is None and empty:  # the kept-nothing fallback: zero-advantage rows
        adv = torch.zeros(len(b.keys))
    if adv is not None and skip is not None:
        adv = adv.double() * skip.row_weights(uid)
    return adv, sc


def filter_kv_batch(
    batch: KVBatchMeta,
    filt: CompletionFilter,
    options: FilterOptions,
    *,
    store: Any = tq,
    more: Any = None,
    return_groups: bool = False,
    skip: VerlSkipStage | None = None,
) -> Any:
    """Filter one sampled v1 batch; ``more(n_prompts) -> KVBatchMeta | None`` rolls out and samples
    ``n`` more prompts (refill). Dropped rows are cleared from ``store`` (TransferQueue). Returns
    ``(kept batch, metrics)``, plus with ``return_groups`` ``{uid: (rewards, advantages)}`` of the
    full group of every uid with a kept row. With prompt ``skip`` (no refill), every rolled-out
    group is observed and each kept row's stored advantage is multiplied by its prompt's weight."""
    rounds: list[KVBatchMeta] = []
    uids: dict[int, list[Any]] = {}
    scores: list[torch.Tensor] = []

    def produce(n_prompts: int) -> Round[KVBatchMeta] | None:
        b = batch if not rounds else (more(n_prompts) if more is not None else None)
        if b is None or len(b.keys) == 0:
            return None
        rounds.append(b)
        fields = store.kv_batch_get(keys=b.keys, partition_id=b.partition_id, select_fields=list(KV_FIELDS))
        rewards, uid, mask = rewards_from_fields(fields)
        uids[id(b)] = uid
        if skip is not None:
            skip.observe_rows(uid, rewards, mask.sum(-1))
        scored = scored_batch(rewards, uid, mask, options.advantage_config)
        scores.append(scored.rewards.detach().double().cpu())
        return Round(payload=b, scored=scored, num_prompts=len(set(uid)))

    target = options.target_rows or len(batch.keys)
    outcome = _refiller(batch, target, options, more).fill(filt, produce)
    keys: list[str] = []
    tags: list[dict] = []
    kept_by_round = _kept_by_round(outcome, options)
    empty = _keep_something(kept_by_round, rounds, outcome, options)
    train_adv = {id(sel.round.payload): _train_advantages(sel, options) for sel in outcome.selections}
    weighted = [sel for sel in outcome.selections if sel.weights is not None]
    groups: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
    for b in rounds:
        adv, sc = _round_advantages(b, train_adv, empty, skip, uids[id(b)])
        kept_rows = _store_kept(b, kept_by_round.get(id(b), set()), adv, store)
        for i in kept_rows:
            keys.append(b.keys[i])
            tags.append(b.tags[i])
        if kept_rows and return_groups and sc is not None:
            assert adv is not None
            groups.update(_full_groups(sc, uids[id(b)], kept_rows, adv, bool(weighted)))
    metrics = _filter_metrics(outcome, weighted, len(keys), target, empty, scores)
    if skip is not None:
        metrics.update(skip.step_metrics())
    out = KVBatchMeta(
        partition_id=batch.partition_id, keys=keys, tags=tags, extra_info=dict(batch.extra_info or {})
    )
    return (out, metrics, groups) if return_groups else (out, metrics)


def restore_group_advantages(batch: KVBatchMeta, *, store: Any = tq) -> KVBatchMeta:
    """Overwrite ``advantages``/``returns`` of ``batch`` with the full-group advantages the filter
    stored (verl's ``_compute_advantage`` only sees the kept rows, so it would re-normalise within
    them). Synthetic padding rows copy a real row's field but have an all-zero response mask."""
    data = store.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=[SEQ_ADV_FIELD, "response_mask"]
    )
    seq = data[SEQ_ADV_FIELD].reshape(-1).float()
    mask = data["response_mask"]
    if getattr(mask, "is_nested", False):
        parts = [seq[i] * m.float() for i, m in enumerate(mask.unbind())]
        adv = torch.nested.nested_tensor(parts, layout=torch.jagged)
        ret = torch.nested.nested_tensor([p.clone() for p in parts], layout=torch.jagged)
    else:
        adv = seq[:, None] * mask.float()
        ret = adv.clone()
    fields = TensorDict({"advantages": adv, "returns": ret}, batch_size=[len(batch.keys)])
    store.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
    return batch


class _FilteringReplayBuffer:
    """Wraps verl's replay buffer: ``sample`` returns only the rows the filter keeps."""

    def __init__(self, inner: Any, trainer: GrpoPartsSyncTrainer, store: Any = tq):
        self._inner = inner
        self._trainer = trainer
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        batch, metrics = self._inner.sample(
            global_steps=global_steps, partition_id=partition_id, batch_size=batch_size
        )
        opts, filt = self._trainer.grpo_parts_filter_options, self._trainer.grpo_parts_filter
        if partition_id == "val" or opts is None or filt is None:
            return batch, metrics
        skip = self._trainer.grpo_parts_skip

        def more(n_prompts: int) -> KVBatchMeta | None:
            # verl submits prompts in whole dataloader fetches of data.gen_batch_size
            data_cfg = self._trainer.config.data
            g = int(data_cfg.get("gen_batch_size", None) or data_cfg.train_batch_size)
            n_prompts = -(-n_prompts // g) * g
            self._trainer._add_prompts_to_generate(n_prompts)
            b, m = self._inner.sample(
                global_steps=global_steps, partition_id=partition_id, batch_size=n_prompts
            )
            metrics.update({f"parts/refill/{k}": v for k, v in m.items()})
            return b

        kept, fmetrics = filter_kv_batch(
            batch, filt, opts, store=self._store, more=more if opts.refill_rounds else None, skip=skip
        )
        metrics.update(fmetrics)
        return kept, metrics


def build_skip_stage(options: FilterOptions | None, config: Any, fetch: Any) -> VerlSkipStage | None:
    """The prompt skipping stage ``grpo_parts.filter.prompt_skip`` asks for (None: every prompt
    rolled out); what cannot stay unbiased is refused in one line."""
    from grpo_parts.skip.stage import checked_skipper

    if options is None:
        return None
    parts = options.parts
    skipper = checked_skipper(
        parts.prompt_skip,
        parts.prompt_skip_kwargs,
        where="grpo_parts.filter.prompt_skip_kwargs",
        switch=f"grpo_parts.filter.prompt_skip={parts.prompt_skip!r}",
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
        self.grpo_parts_filter_options = filter_options_from(config)
        self.grpo_parts_filter = (
            None if self.grpo_parts_filter_options is None else self.grpo_parts_filter_options.build()
        )
        if self.grpo_parts_filter is not None:
            check_algorithm(config)
            check_weighted(self.grpo_parts_filter, self.grpo_parts_filter_options)
        self.grpo_parts_skip = build_skip_stage(
            self.grpo_parts_filter_options, config, lambda: self._fetch_one_gen_batch()
        )
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
        # verl branches on ``trainer_mode == "sync"`` in several places (replay buffer class, refill,
        # checkpoint restore); this mode *is* the sync trainer, so it answers "sync" from here on.
        # (``PPOTrainer.__init__`` sets trainer_mode just before calling this method.)
        self.trainer_mode = "sync"
        inner = super()._build_replay_buffer()
        return inner if self.grpo_parts_filter is None else _FilteringReplayBuffer(inner, self)


def register() -> None:
    """Register ``grpo_parts_sync`` with verl's trainer registry (idempotent)."""
    if TRAINER_REGISTRY.get(NAME) is not GrpoPartsSyncTrainer:
        register_trainer(NAME)(GrpoPartsSyncTrainer)
