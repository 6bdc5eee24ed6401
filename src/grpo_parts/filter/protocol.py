"""The ``CompletionFilter`` Protocol: choose which scored completions the policy update trains on.

A filter runs after rewards and advantages and before the old-policy / reference forwards, so
those forwards run on the kept rows only. When the kept set is smaller than the batch the loop
wants, the result asks for ``extra_prompts_wanted`` more prompts (refill).
The loop recomputes loss normalisation (token counts) for the kept set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from ..counters import KEPT_FRACTION, WEIGHTED_ROWS
from ..types import FilterResult, ScoredBatch

if TYPE_CHECKING:
    from ..core import LossConfig

__all__ = [
    "KEPT_FRACTION",
    "NUM_KEPT",
    "WEIGHTED_ROWS",
    "CompletionFilter",
    "FilterResult",
    "ScoredBatch",
    "WeighsLoss",
]

#: ``FilterResult.info`` keys that several filters write (counter names: :mod:`grpo_parts.counters`,
#: the trainer logs the bare name, the framework doors ``parts/filter/<name>``): the share of the
#: batch's rows kept (KEPT_FRACTION), the rows trained with an importance weight (WEIGHTED_ROWS,
#: ``dppo``; both imported above) and how many rows were kept
NUM_KEPT = "num_kept"


@runtime_checkable
class CompletionFilter(Protocol):
    name: ClassVar[str]

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        """Return the kept rows (ascending). ``target_size``: how many completions the loop wants
        to train on; a filter that keeps fewer says how many extra prompts would fill the gap."""
        ...

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]:
        """Why this filter cannot handle ``batch`` (empty list = supported)."""
        ...


@runtime_checkable
class WeighsLoss(Protocol):
    """A filter whose results carry importance weights (``FilterResult.weights``, e.g. ``dppo``): the
    loss must multiply each kept row by its weight and keep the *whole* batch's denominators, fixed
    before the draw. Every loop that trains on its rows asks :meth:`loss_not_supported_reasons`
    before the first step and refuses a loss it cannot keep unbiased; it never refills or trims such
    a draw by priority (both depend on the draw)."""

    def loss_not_supported_reasons(self, config: LossConfig) -> list[str]:
        """Why the weighted loss under ``config`` would not be unbiased (empty list = it is)."""
        ...
