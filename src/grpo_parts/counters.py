"""Every counter's one name, the one way each door spells it, and the counting of each part's calls.

A counter is named once, ``<name>`` (e.g. ``weighted_rows``), and belongs to one part (``filter``).
``grpo-parts train`` writes the bare name to ``metrics.jsonl``; the framework doors (TRL, verl,
OpenRLHF) add their one prefix, ``parts/<part>/`` (:func:`framework_key`), next to the framework's
own metrics. Nothing else is added, so a door test looks a counter up by :func:`door_key`; no
adapter spells a ``parts/...`` key itself.

:class:`PartCounters` counts, per step, the calls a part served (rollouts for a sampler, forwards
for an attention backend, ``select`` calls for a filter) and the calls that went to the
framework's own path instead, with the reason (each distinct reason logged once at WARNING)::

    counters = PartCounters(PART_UNITS, logger)
    counters.ran("attention")                         # a forward went through the backend
    counters.fell_back("attention", "MoE aux loss")   # a forward ran the framework's own code
    metrics.update(counters.flush())  # {"parts/attention/forwards": 1.0, "parts/attention/fallbacks": 1.0}
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

#: the prefix every framework door puts before ``<part>/<name>``
FRAMEWORK_PREFIX = "parts"

# ---------------------------------------------------------------------------------- filter
#: rows of a filter's kept set trained with an importance weight (a weighing filter, ``dppo``)
WEIGHTED_ROWS = "weighted_rows"
#: the share of a batch's rows a filter kept
KEPT_FRACTION = "kept_fraction"
#: rows a filter kept and the step's target (verl); rows scored and kept (TRL)
ROWS_KEPT, TARGET_ROWS = "rows_kept", "target_rows"
ROWS_SCORED, NUM_KEPT = "rows_scored", "num_kept"
#: the mean reward of every rolled-out row (verl's own ``critic/score`` is over the kept rows)
SCORE_MEAN_ROLLED_OUT = "score_mean_rolled_out"
#: steps whose filter kept nothing (verl trains a zero-advantage mini-batch; OpenRLHF skips the step)
EMPTY_BATCH_STEPS, SKIPPED_STEPS = "empty_batch_steps", "skipped_steps"
#: rows the rounding to a framework's multiple added (> 0) or dropped (< 0); TRL: rows it changed
ROUNDED_ROWS, ROUNDING = "rounded_rows", "rounding"
#: rows with no loss token (TRL's ``mask_truncated_completions``); prompts a refill rolled out
NO_LOSS_ROWS, REFILL_PROMPTS = "no_loss_rows", "refill_prompts"

# ---------------------------------------------------------------------------------- prompt_skip
#: prompts a prompt skipper left out before rollout, and the prompts it drew
PROMPTS_SKIPPED = "prompts_skipped"
PROMPTS_DRAWN = "prompts_drawn"

# ---------------------------------------------------------------------------------- attention
#: the attention calls of each kernel path (``calls_varlen_cascade``, ``calls_masked_sdpa``, ...):
#: ``ATTENTION_CALLS + path``, counted from ``SharedPrefixAttention.attention_calls``
ATTENTION_CALLS = "calls_"
#: tokens the shared-prefix layouts ran, of the packed rows, of a padding-free layout; and the
#: largest ratios of one call (verl)
GRID_TOKENS, PACKED_TOKENS, PADDING_FREE_TOKENS = "grid_tokens", "packed_tokens", "padding_free_tokens"
GRID_OVER_PACKED_MAX, GRID_OVER_PADDING_FREE_MAX = "grid_over_packed_max", "grid_over_padding_free_max"
#: the largest log-prob difference to the framework's own forward on the first batch (OpenRLHF)
FIRST_BATCH_DIFF = "first_batch_logprob_max_abs_diff"
#: verl's forward-only (log-prob) calls are counted apart: ``LOGPROB + forwards`` ...
LOGPROB = "logprob_"

# ---------------------------------------------------------------------------------- sampler
#: the rollout copy of the policy received the actor's weights; a rollout ran on a frozen copy
WEIGHT_SYNCS, FROZEN_ROLLOUTS = "weight_syncs", "frozen_rollouts"

# ---------------------------------------------------------------------------------- every part
#: a part's calls that went to the framework's own path
FALLBACKS = "fallbacks"
#: what one served call of each part is (:class:`PartCounters`' units)
PART_UNITS: dict[str, str] = {"sampler": "rollouts", "attention": "forwards", "filter": "calls"}

#: counter -> the part it belongs to (for the framework doors' ``parts/<part>/`` prefix)
PART_OF: dict[str, str] = {
    **dict.fromkeys((WEIGHTED_ROWS, KEPT_FRACTION, ROWS_KEPT, TARGET_ROWS, ROWS_SCORED, NUM_KEPT,
                     SCORE_MEAN_ROLLED_OUT, EMPTY_BATCH_STEPS, SKIPPED_STEPS, ROUNDED_ROWS, ROUNDING,
                     NO_LOSS_ROWS, REFILL_PROMPTS), "filter"),
    PROMPTS_SKIPPED: "prompt_skip",
    PROMPTS_DRAWN: "prompt_skip",
    **dict.fromkeys((GRID_TOKENS, PACKED_TOKENS, PADDING_FREE_TOKENS, GRID_OVER_PACKED_MAX,
                     GRID_OVER_PADDING_FREE_MAX, FIRST_BATCH_DIFF), "attention"),
    WEIGHT_SYNCS: "sampler",
    FROZEN_ROLLOUTS: "sampler",
}  # fmt: skip


def framework_key(part: str, name: str) -> str:
    """``parts/<part>/<name>``: how TRL, verl and OpenRLHF log counter ``name`` of ``part``."""
    return f"{FRAMEWORK_PREFIX}/{part}/{name}"


def framework_keys(part: str, values: Mapping[str, Any]) -> dict[str, float]:
    """``values`` (counter name -> value) under ``part``'s framework keys, as floats."""
    return {framework_key(part, k): float(v) for k, v in values.items()}


def door_key(door: str, name: str) -> str:
    """The metric key of counter ``name`` behind ``door`` (``train``: the bare name)."""
    part = "attention" if name.startswith(ATTENTION_CALLS) else PART_OF[name]
    return name if door == "train" else framework_key(part, name)


class PartCounters:
    """Per-mode call counts of each part. ``units`` maps a part (the metric's middle name, e.g.
    ``"attention"``) to what one call of it is (e.g. ``"forwards"``); only those parts are counted.
    :meth:`track` makes a part report zeros in steps where it saw no call."""

    def __init__(
        self, units: Mapping[str, str], logger: logging.Logger | None = None, prefix: str = FRAMEWORK_PREFIX
    ) -> None:
        self.units = dict(units)
        self.prefix = prefix
        self.logger = logger or logging.getLogger(__name__)
        self.tracked: set[str] = set()
        #: every distinct fallback reason seen, per part (first-seen order)
        self.reasons: dict[str, list[str]] = {}
        self._ran: Counter[tuple[str, str]] = Counter()
        self._fell: Counter[tuple[str, str]] = Counter()
        self._totals: Counter[tuple[str, str]] = Counter()

    def _check(self, part: str) -> None:
        if part not in self.units:
            raise KeyError(f"part: expected one of {sorted(self.units)}, got {part!r}")

    def track(self, part: str) -> None:
        self._check(part)
        self.tracked.add(part)

    def ran(self, part: str, n: int = 1, mode: str = "train") -> None:
        self.track(part)
        self._ran[mode, part] += n
        self._totals["ran", part] += n

    def fell_back(self, part: str, reason: str, n: int = 1, mode: str = "train") -> None:
        self.note(part, reason)
        self._fell[mode, part] += n
        self._totals["fallbacks", part] += n

    def note(self, part: str, reason: str) -> None:
        """Log a fallback ``reason`` of ``part`` at WARNING unless it was logged before (e.g. at
        construction, when a part is refused); counts no call."""
        self.track(part)
        seen = self.reasons.setdefault(part, [])
        if reason not in seen:
            seen.append(reason)
            self.logger.warning("grpo_parts: %s falls back (logged once per reason): %s", part, reason)

    def total(self, part: str, kind: str = "ran") -> int:
        """Calls since construction: ``kind`` is ``"ran"`` or ``"fallbacks"``."""
        return self._totals[kind, part]

    def flush(self, mode: str = "train") -> dict[str, float]:
        """``{"<prefix>/<part>/<unit>": ran, "<prefix>/<part>/fallbacks": fell}`` for every tracked
        part (zeros included), then reset ``mode``'s counts."""
        out: dict[str, float] = {}
        for part in sorted(self.tracked):
            out[f"{self.prefix}/{part}/{self.units[part]}"] = float(self._ran.pop((mode, part), 0))
            out[f"{self.prefix}/{part}/{FALLBACKS}"] = float(self._fell.pop((mode, part), 0))
        return out


def attention_calls(backend: Any) -> Counter[str]:
    """A copy of ``backend``'s attention calls per path so far (``CountsAttentionCalls``; empty for a
    backend that counts none): adapters log the difference of two reads (:data:`ATTENTION_CALLS`)."""
    calls = getattr(backend, "attention_calls", None)
    return Counter(calls) if isinstance(calls, Mapping) else Counter()
