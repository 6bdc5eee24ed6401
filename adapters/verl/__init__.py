"""grpo_parts as a verl 0.9.1 plugin: ``pip install -e '.[verl]'`` in a checkout (by name:
``pip install 'grpo-parts[verl]'``), plus ``pip install --no-deps verl==0.9.1``.

Importing this package imports nothing from verl. Importing :mod:`grpo_parts_adapters.verl.plugin`
registers every part with verl's own registries (verl loads it through the ``verl.plugins`` entry
point, ``VERL_USE_EXTERNAL_MODULES`` or ``actor_rollout_ref.model.external_lib``):

* advantage estimator ``grpo_parts_grpo`` (``algorithm.adv_estimator=grpo_parts_grpo``) -- :mod:`.advantage`;
* CPPO / DAPO / PODS filters with refill before the old-policy, reference and actor passes, through
  verl's custom-sampler seam (``trainer.v1.sampler.custom_sampler`` -> :class:`.sampler.FilteringReplayBuffer`,
  with the ``grpo_parts_grpo`` estimator) -- :mod:`.sampler`, :mod:`.kv_filter`, :mod:`.filtering`; the
  trainer mode ``grpo_parts_sync`` puts the same buffer around verl's own -- :mod:`.trainer`;
* prompt skipping before rollout (``+grpo_parts.filter.prompt_skip=history``), in the trainer mode
  ``grpo_parts_sync`` only: it draws each step's prompts -- :mod:`.skipping`;
* shared-prefix log-probs for the actor's and reference's FSDP engines, grouped by ``uid``, switched
  on by config keys (``actor_rollout_ref.actor._target_=grpo_parts_adapters.verl.config.FSDPActorConfig
  +actor_rollout_ref.actor.grpo_parts.attention=shared_prefix``) -- :mod:`.config`, :mod:`.engine`,
  :mod:`.attention`;
* agent loop ``grpo_parts_agent`` running a grpo_parts ``Sampler`` -- :mod:`.agent_loop`; vLLM
  speculative config and draft-weight sync -- :mod:`.speculative`.

See docs/adapters/verl.md for the override set and how each part scales across Ray workers.
"""

PLUGIN_MODULE = "grpo_parts_adapters.verl.plugin"

__all__ = ["PLUGIN_MODULE"]
