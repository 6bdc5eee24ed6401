"""The step after a rank planned its shared-prefix call, behind every framework door: fall back to
the framework's own forward on every rank together, and agree on the number of model calls."""

from __future__ import annotations

from typing import Any

import torch

from ..distributed import agree_max, ranks_of

__all__ = ["agree_fallback"]


def agree_fallback(
    reason: str | None, calls: int, group: Any, device: torch.device | None, other: str
) -> tuple[str | None, int]:
    """After a rank planned its shared-prefix call: ``(why it runs the framework's own forward, or
    None; the model calls to make)``. Ranks that share sharded weights (FSDP, ZeRO-3) must make the
    same calls, so with several ranks in ``group`` one all-reduce makes every rank fall back when
    any does (``other``: the reason of a rank that did not itself), and each make the most calls of
    any rank. One process: as given."""
    if ranks_of(group) <= 1:
        return reason, calls
    any_fallback, most = agree_max([int(reason is not None), calls], group, device)
    if any_fallback and reason is None:
        reason = other
    return reason, most
