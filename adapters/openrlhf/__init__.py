"""grpo_parts inside OpenRLHF 0.11.2's Ray GRPO loop (thin translation layer, no maths of its own).

OpenRLHF has no plugin registry, so the parts go in by subclassing, and an entry script
(``python -m grpo_parts_adapters.openrlhf.launch``) runs OpenRLHF's own ``cli/train_ppo_ray`` with
that script's imports resolving to the subclasses (nothing global is reassigned). Modules (each
imports OpenRLHF only when it is itself imported):

* :mod:`.config` -- ``OpenRLHFPartsConfig``: the ``--grpo_parts.*`` flags, carried in ``strategy.args``.
* :mod:`.layout` -- OpenRLHF's right-padded ``sequences``/``action_mask`` <-> ``LogprobBatch`` (no OpenRLHF import).
* :mod:`.actor` -- AttentionBackend: ``GRPOPartsActor`` (OpenRLHF's ``Actor``; ``use_backend(backend)``
  makes its ``forward`` compute log-probs with the backend: shared-prefix for padded and packed inputs).
* :mod:`.experience` -- CompletionFilter: ``GRPOPartsExperienceMaker``, a ``RemoteExperienceMaker``
  computing ``group_norm`` advantages with :func:`grpo_parts.core.group_advantages`, filtering before
  the old/ref forwards, refilling through the samples generator.
* :mod:`.samples` -- ``GRPOPartsSamplesGenerator``: refill prompts from the same stream, vLLM woken
  after DeepSpeed is offloaded; counts sampler rollouts.
* :mod:`.agent` -- Sampler: ``GRPOPartsAgentExecutor`` for ``--train.agent_func_path``.
* :mod:`.rollout` -- the rollout actor for an agent file: OpenRLHF's weight broadcast reaches the
  executor's sampler (no vLLM behind a grpo_parts executor).
* :mod:`.vllm_spec` -- speculative config for OpenRLHF's vLLM engines and draft weight sync.
* :mod:`.ray_actors` -- the Ray actor / trainer subclasses the entry script uses; per-step part
  counters into the trainer's status dict.
* :mod:`._scoped` -- running OpenRLHF's code with some of its names bound to ours, in private scope.
* :mod:`.launch` -- the entry script. See docs/adapters/openrlhf.md.
"""

from __future__ import annotations

from .config import OpenRLHFPartsConfig

__all__ = ["OpenRLHFPartsConfig"]
