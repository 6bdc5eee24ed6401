"""The Ray actors the launcher swaps into OpenRLHF's ``cli/train_ppo_ray``.

Each subclasses OpenRLHF's class (the original behind its ``@ray.remote`` wrapper) and reads the
:class:`~.config.PartsConfig` from ``strategy.args.grpo_parts``, which Ray ships with the strategy:

* :class:`GRPOPartsPolicyModelActor` / :class:`GRPOPartsReferenceModelActor`: after OpenRLHF builds
  the model, attach the attention backend to its ``Actor`` (policy forward+backward, old-policy and
  reference forwards); the policy's replay buffer keeps groups in one micro-batch
  (:class:`~.replay.GroupedReplayBuffer`) when ``grouped_microbatches`` says so.
* :class:`GRPOPartsPPOTrainer`: replaces the experience maker with
  :class:`~.experience.GRPOPartsExperienceMaker` (filter + refill through this trainer's samples
  generator), skips steps where the filter kept nothing, and logs ``grpo_parts/*`` metrics.
"""

from __future__ import annotations

from typing import Any

import ray
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ray.launcher import ReferenceModelActor
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from .actor import attach_attention, hf_model
from .config import PartsConfig
from .experience import GRPOPartsExperienceMaker, NothingKept


def original_class(actor_class: Any) -> type:
    """The class behind a ``@ray.remote`` actor class (Ray forbids subclassing the wrapper)."""
    return actor_class.__ray_metadata__.modified_class.__ray_actor_class__


def _attach(actor: Any, args: Any, role: str) -> None:
    parts = PartsConfig.from_args(args)
    if parts.attention == "reference":
        return
    backend = parts.build_attention(hf_model(actor.model))
    attach_attention(actor, backend)
    print(f"[grpo_parts] {role}: log-probs by attention backend {backend.name!r}")


@ray.remote(num_gpus=1)
class GRPOPartsPolicyModelActor(original_class(PolicyModelActor)):  # type: ignore[misc]
    def init_model_from_pretrained(
        self, strategy: Any, pretrain: str, max_steps: Any = None, vllm_engines: Any = None
    ) -> None:
        super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        _attach(self.actor, strategy.args, "policy")
        if PartsConfig.from_args(strategy.args).use_grouped_microbatches(
            strategy.args.train.dynamic_batch_enable
        ):
            from .replay import GroupedReplayBuffer

            self.trainer.replay_buffer = GroupedReplayBuffer.replacing(self.trainer.replay_buffer)


@ray.remote(num_gpus=1)
class GRPOPartsReferenceModelActor(original_class(ReferenceModelActor)):  # type: ignore[misc]
    def init_model_from_pretrained(self, strategy: Any, pretrain: str) -> None:
        super().init_model_from_pretrained(strategy, pretrain)
        _attach(self.model, strategy.args, "reference")


@ray.remote
class GRPOPartsPPOTrainer(original_class(PPOTrainer)):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        parts = PartsConfig.from_args(self.args)
        self.experience_maker = GRPOPartsExperienceMaker(
            self.actor_model_group,
            self.critic_model_group,
            self.reward_model_group,
            self.reference_model_group,
            self.kl_ctl,
            self.strategy,
            self.tokenizer,
            completion_filter=parts.build_filter(),
            samples_generator=self.samples_generator,
            generate_kwargs=self.generate_kwargs,
            refill_rounds=parts.refill_rounds,
        )
        self.skipped_steps = 0

    def train_step(self, rollout_samples: Any, global_step: int) -> Any:
        try:
            status, step = super().train_step(rollout_samples, global_step)
        except NothingKept as e:
            self.skipped_steps += 1
            print(f"[grpo_parts] step {global_step} skipped: {e}")
            return {"grpo_parts/skipped_steps": float(self.skipped_steps)}, global_step
        status.update({f"grpo_parts/{k}": v for k, v in self.experience_maker.last_info.items()})
        return status, step
