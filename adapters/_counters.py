"""What went through each grpo_parts part, and what fell back to the framework's own code path.

Every adapter counts, per step, the calls a part served (:meth:`PartCounters.ran`: rollouts for a
sampler, forwards for an attention backend, ``select`` calls for a filter) and the calls that went to
the framework's own path instead (:meth:`PartCounters.fell_back`, with the reason). Each distinct
``(part, reason)`` is logged once at WARNING; :meth:`PartCounters.flush` returns the counts of one
mode as metrics and resets them::

    counters = PartCounters({"sampler": "rollouts", "attention": "forwards", "filter": "calls"}, logger)
    counters.ran("attention")                         # a forward went through the backend
    counters.fell_back("attention", "MoE aux loss")   # a forward ran the framework's own code
    metrics.update(counters.flush())  # {"parts/attention/forwards": 1.0, "parts/attention/fallbacks": 1.0}

Framework-free (no TRL/verl/OpenRLHF import), so every adapter can use it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["PartCounters", "attention_calls"]


class PartCounters:
    """Per-mode call counts of each part. ``units`` maps a part (the metric's middle name, e.g.
    ``"attention"``) to what one call of it is (e.g. ``"forwards"``); only those parts are counted.
    :meth:`track` makes a part report zeros in steps where it saw no call."""

    def __init__(
        self, units: Mapping[str, str], logger: logging.Logger | None = None, prefix: str = "parts"
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
            out[f"{self.prefix}/{part}/fallbacks"] = float(self._fell.pop((mode, part), 0))
        return out


def attention_calls(backend: Any) -> Counter[str]:
    """A copy of an attention backend's attention calls per path so far (``varlen_cascade``,
    ``masked_sdpa``, ...: ``SharedPrefixAttention.attention_calls``, its padding-free layout's
    kernels); empty for a backend that counts none. Adapters log the difference of two reads as
    ``parts/attention/calls_<path>``."""
    calls = getattr(backend, "attention_calls", None)
    return Counter(calls) if isinstance(calls, Mapping) else Counter()
