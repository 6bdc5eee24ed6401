"""The ``CompletionFilter`` Protocol: choose which scored completions the policy update trains on.

A filter runs after rewards and advantages and before the old-policy / reference forwards, so
those forwards run on the kept rows only. When the kept set is smaller than the batch the loop
wants, the result asks for ``extra_prompts_wanted`` more prompts (dynamic allocation / refill).
The loop recomputes loss normalisation (token counts) for the kept set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from ..types import FilterResult, ScoredBatch

if TYPE_CHECKING:
    from ..core import LossConfig

__all__ = ["KEPT_FRACTION", "NUM_KEPT", "CompletionFilter", "FilterResult", "ScoredBatch", "WeighsLoss"]

#: ``FilterResult.info`` keys that several filters write (the refill loop's outcome and the
#: trainer's metric of the same name too; adapters log them as ``parts/filter/<key>``): the share of
#: the batch's rows kept ...
KEPT_FRACTION = "kept_fraction"
#: ... and how many rows were kept
NUM_KEPT = "num_kept"
#: rows trained with an importance weight (a weighing filter, ``dppo``): the trainer logs
#: ``filter_<name>``, TRL ``parts/filter/<name>``, verl and OpenRLHF ``grpo_parts/filter/<name>``
WEIGHTED_ROWS = "weighted_rows"


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
