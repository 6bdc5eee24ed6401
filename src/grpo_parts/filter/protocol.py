"""The ``CompletionFilter`` Protocol: choose which scored completions the policy update trains on.

A filter runs after rewards and advantages and before the old-policy / reference forwards, so
those forwards run on the kept rows only. When the kept set is smaller than the batch the loop
wants, the result asks for ``extra_prompts_wanted`` more prompts (dynamic allocation / refill).
The loop recomputes loss normalisation (token counts) for the kept set.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from ..types import FilterResult, ScoredBatch

__all__ = ["KEPT_FRACTION", "NUM_KEPT", "CompletionFilter", "FilterResult", "ScoredBatch"]

#: ``FilterResult.info`` keys that several filters write (the refill loop's outcome and the
#: trainer's metric of the same name too; adapters log them as ``parts/filter/<key>``): the share of
#: the batch's rows kept ...
KEPT_FRACTION = "kept_fraction"
#: ... and how many rows were kept
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
