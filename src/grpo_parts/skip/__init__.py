"""Prompt skippers: skip prompts *before* rollout, unbiasedly (the ``PromptSkipper`` Protocol).

* :mod:`.protocol` -- :class:`PromptSkipper`, its decisions and abilities, and the check that a loss
  stays unbiased under skipping (:func:`~.protocol.prompt_skip_reasons`, the rule itself in
  :mod:`grpo_parts.core.unbiased`);
* :mod:`.reference` -- ``none``: every prompt rolled out;
* :mod:`.history` -- ``history``: a prompt's zero-variance history lowers its inclusion probability
  (GRESO's rule, with ``1 / p`` weights);
* :mod:`.draw` -- :class:`~.draw.PromptDraw`, the stream that draws a round of prompts past a
  skipper (the sampling design: :mod:`grpo_parts.core.inclusion`).

Select by name with :func:`get_skipper_class`; build with :func:`grpo_parts.build.build_prompt_skipper`.
"""

from __future__ import annotations

from ..registry import PartClass, load_class
from .protocol import PromptSkipper

#: prompt skippers by name (``parts.prompt_skip``) -> "module:Class", imported lazily
IMPLEMENTATIONS: dict[str, str] = {
    "none": "grpo_parts.skip.reference:KeepEveryPrompt",
    "history": "grpo_parts.skip.history:HistorySkipper",
}


def get_skipper_class(name: str) -> PartClass[PromptSkipper]:
    """The prompt skipper registered as ``name`` in :data:`IMPLEMENTATIONS` (imported on first use)."""
    return load_class(IMPLEMENTATIONS, name, "prompt_skip")


__all__ = ["IMPLEMENTATIONS", "PromptSkipper", "get_skipper_class"]
