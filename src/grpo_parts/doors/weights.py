"""A weighted filter's (``dppo``) row weights behind a framework door: each drawn row's ``1 / p``
times ``kept / rolled-out rows``. The frameworks divide each optimizer step by its fixed row count,
so the factor restores the full batch's normaliser (docs/filter.md, "Weighted filters")."""

from __future__ import annotations

import torch

__all__ = ["kept_scale", "weighted_rows"]


def kept_scale(kept: int, rolled_out: int, multiple: int = 1) -> float:
    """``K' / N``: the kept rows (padded up to ``multiple`` by the framework's no-op rows, verl) over
    the rolled-out rows; 0 with nothing rolled out."""
    return (-(-kept // multiple) * multiple) / rolled_out if rolled_out else 0.0


def weighted_rows(
    rolled_out: int, drawn: torch.Tensor, weights: torch.Tensor, kept: int, multiple: int = 1
) -> torch.Tensor:
    """``[rolled_out]`` float64 on the CPU: each drawn row's ``1 / p`` (``weights``, in ``drawn``'s
    order) times :func:`kept_scale`; 0 for rows not drawn (rows the rounding re-added train with 0)."""
    out = torch.zeros(rolled_out, dtype=torch.float64)
    out[drawn.cpu()] = weights.detach().cpu().double() * kept_scale(kept, rolled_out, multiple)
    return out
