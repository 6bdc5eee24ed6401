"""Every counter's one name, and the one way each door spells it.

A counter is named once, ``<name>`` (e.g. ``weighted_rows``), and belongs to one part (``filter``).
``grpo-parts train`` writes the bare name to ``metrics.jsonl``; the framework doors (TRL, verl,
OpenRLHF) add their one prefix, ``parts/<part>/`` (:func:`framework_key`), next to the framework's
own metrics. Nothing else is added, so a door test looks a counter up by :func:`door_key`.
"""

from __future__ import annotations

#: the prefix every framework door puts before ``<part>/<name>``
FRAMEWORK_PREFIX = "parts"

#: rows of a filter's kept set trained with an importance weight (a weighing filter, ``dppo``)
WEIGHTED_ROWS = "weighted_rows"
#: the share of a batch's rows a filter kept
KEPT_FRACTION = "kept_fraction"
#: prompts a prompt skipper left out before rollout, and the prompts it drew
PROMPTS_SKIPPED = "prompts_skipped"
PROMPTS_DRAWN = "prompts_drawn"

#: the attention calls of each kernel path (``calls_varlen_cascade``, ``calls_masked_sdpa``, ...):
#: ``ATTENTION_CALLS + path``, counted from ``SharedPrefixAttention.attention_calls``
ATTENTION_CALLS = "calls_"

#: counter -> the part it belongs to (for the framework doors' ``parts/<part>/`` prefix)
PART_OF: dict[str, str] = {
    WEIGHTED_ROWS: "filter",
    KEPT_FRACTION: "filter",
    PROMPTS_SKIPPED: "prompt_skip",
    PROMPTS_DRAWN: "prompt_skip",
}


def framework_key(part: str, name: str) -> str:
    """``parts/<part>/<name>``: how TRL, verl and OpenRLHF log counter ``name`` of ``part``."""
    return f"{FRAMEWORK_PREFIX}/{part}/{name}"


def door_key(door: str, name: str) -> str:
    """The metric key of counter ``name`` behind ``door`` (``train``: the bare name)."""
    part = "attention" if name.startswith(ATTENTION_CALLS) else PART_OF[name]
    return name if door == "train" else framework_key(part, name)


__all__ = [
    "ATTENTION_CALLS",
    "FRAMEWORK_PREFIX",
    "KEPT_FRACTION",
    "PART_OF",
    "PROMPTS_DRAWN",
    "PROMPTS_SKIPPED",
    "WEIGHTED_ROWS",
    "door_key",
    "framework_key",
]
