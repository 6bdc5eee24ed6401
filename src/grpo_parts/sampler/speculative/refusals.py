"""Never silently off: why a rollout's decode loop could not take its fast paths (the lean forward
and the shared-prompt decode attention, checked per rollout against the policy as the trainer hands
it over), logged and counted in the rollout's stats, so a lost path shows in the metrics."""

from __future__ import annotations

import logging

from .. import stats as keys
from .decode_attention import GROUP_SIZE_ONE

log = logging.getLogger("grpo_parts.sampler")


class PathRefusals:
    """The reasons of the last rollout per path (``lean``, ``attention``; empty: it could run); each
    distinct set of reasons is logged once per sampler (an evaluation's one-row-per-prompt rollouts
    between training rollouts do not log again)."""

    def __init__(self) -> None:
        self.lean: list[str] = []
        self.attention: list[str] = []
        self._logged: set[tuple[str, ...]] = set()

    def record(self, stats: dict[str, float], lean_off: list[str], lean_mode: str, attention_off: list[str],
               attention_mode: str) -> None:  # fmt: skip
        """Count this rollout's refusals in ``stats`` and log reasons not logged before.
        ``*_off``: why the path does not run (``[]``: it may); ``*_mode``: its config value
        (``"off"``: turned off, not refused)."""
        lean = lean_off if lean_mode != "off" else []
        attention = attention_off if attention_mode != "off" else []
        if self._first(("lean", *lean)):
            log.warning(
                "speculative sampler: decode forwards run the model's own forward: %s", "; ".join(lean)
            )
        if self._first(("attention", *attention)):
            # one row per prompt (the bench's rollouts, evaluations) is expected: INFO; else a WARNING
            level = logging.INFO if attention == [GROUP_SIZE_ONE] else logging.WARNING
            log.log(
                level,
                "speculative sampler: decode attention reads every row's copy of the prompt: %s",
                "; ".join(attention),
            )
        self.lean, self.attention = lean, attention
        stats[keys.LEAN_FORWARD_REFUSED] = float(bool(lean))
        stats[keys.DECODE_ATTENTION_REFUSED] = float(bool(attention))

    def _first(self, key: tuple[str, ...]) -> bool:
        """``key`` (a path and its reasons) carries reasons and was not logged before."""
        if len(key) < 2 or key in self._logged:
            return False
        self._logged.add(key)
        return True
