"""grpo_parts as a verl 0.9.1 plugin: ``pip install -e '.[verl]'`` in a checkout (by name:
``pip install 'grpo-parts[verl]'``), plus ``pip install --no-deps verl==0.9.1``.

Importing this package imports nothing from verl. Importing :mod:`.plugin` registers every part
with verl's own registries (verl loads it through the ``verl.plugins`` entry point,
``VERL_USE_EXTERNAL_MODULES`` or ``actor_rollout_ref.model.external_lib``): the advantage
estimator ``grpo_parts_grpo`` (:mod:`.advantage`); filters with refill through the one filtering
buffer (:mod:`.sampler`, :mod:`.kv_filter`, :mod:`.filtering`; the trainer mode ``grpo_parts_sync``,
:mod:`.trainer`, puts it around verl's own and adds prompt skipping, :mod:`.skipping`); shared-prefix
log-probs for the actor's and reference's FSDP engines, switched on by config keys (:mod:`.config`,
:mod:`.engine`, :mod:`.attention`); the rollout backend and agent loop running a grpo_parts sampler
(:mod:`.rollout`, :mod:`.agent_loop`); vLLM speculative decoding (:mod:`.speculative`).
docs/adapters/verl.md has the override set and how each part scales across Ray workers.
"""

PLUGIN_MODULE = "grpo_parts_adapters.verl.plugin"

__all__ = ["PLUGIN_MODULE"]
