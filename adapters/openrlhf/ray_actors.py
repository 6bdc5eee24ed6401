"""The Ray actor / trainer classes the launcher's entry script uses instead of OpenRLHF's (each reads
:class:`~.config.OpenRLHFPartsConfig` from ``strategy.args.grpo_parts``): model actors with a
:class:`~.actor.GRPOPartsActor` and grouped micro-batches (:class:`~.replay.GroupedReplayBuffer`); a
trainer with the grpo_parts samples generator and experience maker that skips steps where the filter
kept nothing, logs the part counters and keeps grpo_parts rollout actors' copies in step with the actor."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import ray
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ray.launcher import ReferenceModelActor
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from grpo_parts.counters import FIRST_BATCH_DIFF, SKIPPED_STEPS, PartCounters, door_key, framework_keys
from grpo_parts.doors.skipping import build_skipper
from grpo_parts.wrappers import transformers_model

from ._scoped import with_globals
from .actor import GRPOPartsActor
from .config import OpenRLHFPartsConfig, skip_reasons
from .experience import GRPOPartsExperienceMaker, NothingKept
from .rollout import engines_receiving_weights
from .samples import GRPOPartsSamplesGenerator
from .skipping import SkipStage

#: the prompt skipper's history in OpenRLHF's checkpoint ``client_states``
SKIP_STATE = "grpo_parts_prompt_skip"

logger = logging.getLogger(__name__)


def original_class(actor_class: Any) -> Any:
    """The class behind a ``@ray.remote`` actor class (Ray forbids subclassing the wrapper)."""
    return actor_class.__ray_metadata__.modified_class.__ray_actor_class__


_Policy = original_class(PolicyModelActor)
_Reference = original_class(ReferenceModelActor)
_Trainer = original_class(PPOTrainer)


def use_parts_backend(actor: Any, args: Any, role: str) -> None:
    """Give the built (DeepSpeed-wrapped) ``GRPOPartsActor`` the configured attention backend."""
    parts = OpenRLHFPartsConfig.from_args(args)
    if parts.attention is None:
        return
    backend = parts.build_attention(transformers_model(actor.model))
    actor.use_backend(backend)
    logger.info("grpo_parts %s: log-probs by attention backend %r", role, backend.name)


def counters_of(actor: Any) -> dict[str, float]:
    """The actor's per-step counts (reset), plus the first-batch check once it has run."""
    if not isinstance(actor, GRPOPartsActor):
        return {}
    out = {**actor.counters.flush(), **actor.flush_tokens()}
    if actor.check_first_batch and actor.first_batch_diff is not None:
        out[door_key("openrlhf", FIRST_BATCH_DIFF)] = actor.first_batch_diff
        actor.check_first_batch = False  # reported once
    return out


class PolicyActorParts(_Policy):  # type: ignore[misc, valid-type]
    """The unwrapped policy actor class (for tests; Ray uses :class:`GRPOPartsPolicyModelActor`)."""

    def init_model_from_pretrained(
        self, strategy: Any, pretrain: str, max_steps: Any = None, vllm_engines: Any = None
    ) -> None:
        build = with_globals(_Policy.init_model_from_pretrained, Actor=GRPOPartsActor)
        build(self, strategy, pretrain, max_steps, vllm_engines)
        self.grpo_parts_setup(strategy.args)

    def grpo_parts_setup(self, args: Any) -> None:
        """After OpenRLHF built the actor, its optimizer and its trainer."""
        use_parts_backend(self.actor, args, "policy")
        parts = OpenRLHFPartsConfig.from_args(args)
        if parts.check_first_batch and isinstance(self.actor, GRPOPartsActor):
            self.actor.check_first_batch = self.actor.grpo_backend is not None
        if parts.use_grouped_microbatches(args.train.dynamic_batch_enable):
            from .replay import GroupedReplayBuffer

            self.trainer.replay_buffer = GroupedReplayBuffer.replacing(self.trainer.replay_buffer)

    def grpo_parts_counters(self) -> dict[str, float]:
        return counters_of(self.actor)


class ReferenceActorParts(_Reference):  # type: ignore[misc, valid-type]
    """The unwrapped reference actor class (Ray uses :class:`GRPOPartsReferenceModelActor`)."""

    def init_model_from_pretrained(self, strategy: Any, pretrain: str) -> None:
        with_globals(_Reference.init_model_from_pretrained, Actor=GRPOPartsActor)(self, strategy, pretrain)
        use_parts_backend(self.model, strategy.args, "reference")

    def grpo_parts_counters(self) -> dict[str, float]:
        return counters_of(self.model)


GRPOPartsPolicyModelActor = ray.remote(num_gpus=1)(PolicyActorParts)
GRPOPartsReferenceModelActor = ray.remote(num_gpus=1)(ReferenceActorParts)


class TrainerParts(_Trainer):  # type: ignore[misc, valid-type]
    """The unwrapped trainer class (Ray uses :class:`GRPOPartsPPOTrainer`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        parts = OpenRLHFPartsConfig.from_args(self.args)
        self.parts_counters = PartCounters({"sampler": "rollouts", "filter": "calls"}, logger)
        self.skip_stage = skip_stage(parts, self.args)
        self.samples_generator = GRPOPartsSamplesGenerator(
            strategy=self.strategy,
            prompts_dataloader=self.prompts_dataloader,
            eval_dataloader=self.eval_dataloader,
            tokenizer=self.tokenizer,
            vllm_engines=self.vllm_engines,
            counters=self.parts_counters,
            speculative=bool(parts.speculative_config),
            skip_stage=self.skip_stage,
        )
        self.experience_maker = GRPOPartsExperienceMaker(
            self.actor_model_group,
            self.critic_model_group,
            self.reward_model_group,
            self.reference_model_group,
            self.kl_ctl,
            self.strategy,
            self.tokenizer,
            filter=parts.build_filter(),
            samples_generator=self.samples_generator,
            generate_kwargs=self.generate_kwargs,
            refill_rounds=parts.refill_rounds,
            kept_rounding=parts.kept_rounding,
            counters=self.parts_counters,
        )
        self.model_groups_count = parts.attention is not None
        self.skipped_steps = 0
        self.sampler_engines: list[Any] = []  # engines whose grpo_parts sampler takes the broadcast

    def save_logs_and_checkpoints(
        self, global_step: int, logs_dict: Any = None, client_states: Any = None
    ) -> None:
        """OpenRLHF's, with the prompt skipper's history in the checkpoint's ``client_states`` (the
        same dict the best-checkpoint save reads)."""
        if self.skip_stage is not None and client_states is not None:
            client_states[SKIP_STATE] = self.skip_stage.state_dict()
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    def init_checkpoint_states(self) -> dict[str, Any]:
        """OpenRLHF's, and the prompt skipper's history loaded back from a resumed checkpoint."""
        states = super().init_checkpoint_states()
        if self.skip_stage is not None and SKIP_STATE in states:
            self.skip_stage.load_state_dict(states[SKIP_STATE])
            logger.info("grpo_parts: prompt skipper history restored from the checkpoint")
        elif self.skip_stage is not None and states.get("global_step", 0) > 0:
            logger.warning("grpo_parts: the checkpoint holds no prompt skipper history; it starts empty")
        return states

    def fit(self, global_step: int = 0) -> None:
        self.sampler_engines = engines_receiving_weights(self.vllm_engines)
        if self.sampler_engines:
            # a sampler's copy was loaded from disk: it samples only once it holds the actor's weights
            self.broadcast_to_vllm()
        super().fit(global_step)

    def ppo_train(self, global_steps: int) -> Any:
        """OpenRLHF's, with the sampler engines told first: the actor is about to change, and
        until the broadcast after it their copies are not the trained policy."""
        why = f"the actor is being updated (step {global_steps + 1}) and its weights were not broadcast since"
        ray.get([e.grpo_parts_mark_stale.remote(why) for e in self.sampler_engines])
        return super().ppo_train(global_steps)

    def part_counts(self) -> dict[str, float]:
        """This step's ``parts/*`` counts: the trainer's (sampler, filter) plus the model actors'
        (attention; summed over actors), then reset."""
        total: Counter[str] = Counter(self.parts_counters.flush())
        if self.model_groups_count:
            groups = [g for g in (self.actor_model_group, self.reference_model_group) if g is not None]
            for counts in ray.get(
                [r for g in groups for r in g.async_run_method(method_name="grpo_parts_counters")]
            ):
                total.update(counts)
        return {k: float(v) for k, v in sorted(total.items())}

    def train_step(self, rollout_samples: Any, global_step: int) -> Any:
        try:
            status, step = super().train_step(rollout_samples, global_step)
        except NothingKept as e:
            self.skipped_steps += 1
            logger.warning("grpo_parts: step %d skipped: %s", global_step, e)
            return {
                door_key("openrlhf", SKIPPED_STEPS): float(self.skipped_steps),
                **self.part_counts(),
            }, global_step
        # the filter's diagnostics under the name verl logs them by (parts/filter/<counter>)
        status.update(framework_keys("filter", self.experience_maker.last_info))
        status.update(framework_keys("prompt_skip", self.experience_maker.last_skip_info))
        status.update(self.part_counts())
        return status, step


def skip_stage(parts: OpenRLHFPartsConfig, args: Any) -> SkipStage | None:
    """The prompt skipping stage ``--grpo_parts.prompt_skip`` asks for (None: every prompt rolled
    out); what cannot stay unbiased is refused in one line."""
    skipper = build_skipper(
        parts.prompt_skip,
        parts.prompt_skip_kwargs,
        door="OpenRLHF",
        setting="grpo_parts.prompt_skip",
        reasons=lambda: skip_reasons(args, parts.refill_rounds),
    )
    return None if skipper is None else SkipStage(skipper, int(args.rollout.n_samples_per_prompt))


GRPOPartsPPOTrainer = ray.remote(TrainerParts)
