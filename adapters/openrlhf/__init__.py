"""grpo_parts inside OpenRLHF 0.11.2's Ray GRPO loop (thin translation layer, no maths of its own).

OpenRLHF has no plugin registry, so the parts go in by subclassing, and an entry script
(``python -m grpo_parts_adapters.openrlhf.launch``, :mod:`.launch`) runs OpenRLHF's own
``cli/train_ppo_ray`` with that script's imports resolving to the subclasses (:mod:`._scoped`;
nothing global is reassigned). :mod:`.config` reads the ``--grpo_parts.*`` flags; :mod:`.actor`
(attention), :mod:`.experience` (filter), :mod:`.samples` and :mod:`.skipping` (refill, prompt
skipping), :mod:`.agent` and :mod:`.rollout` (a grpo_parts sampler behind an agent file),
:mod:`.vllm_spec` (vLLM speculative decoding) and :mod:`.ray_actors` (the Ray classes the script
uses) each import OpenRLHF only when imported themselves. docs/adapters/openrlhf.md.
"""

from __future__ import annotations

from .config import OpenRLHFPartsConfig

__all__ = ["OpenRLHFPartsConfig"]
