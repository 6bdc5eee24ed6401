"""A weighted filter's row weights behind every framework door (``grpo_parts.doors.weights``)."""

from __future__ import annotations

import torch

from grpo_parts.doors.weights import kept_scale, weighted_rows


def test_kept_scale_is_the_padded_kept_rows_over_the_rolled_out() -> None:
    assert kept_scale(6, 12) == 0.5
    assert kept_scale(5, 12, multiple=4) == 8 / 12  # verl pads 5 kept rows to 8 no-op-padded rows
    assert kept_scale(3, 0) == 0.0


def test_weighted_rows_weigh_the_drawn_rows_only() -> None:
    drawn = torch.tensor([1, 3])
    w = weighted_rows(4, drawn, torch.tensor([2.0, 4.0]), kept=2)
    assert w.dtype == torch.float64 and w.tolist() == [0.0, 1.0, 0.0, 2.0]  # 1 / p x 2 kept / 4 rolled out


def test_an_unbiased_draw_keeps_the_full_batch_mean() -> None:
    """Drawing each row with probability ``p`` and weighing it ``1 / p x K / N`` under a per-step
    mean over the ``K`` kept rows gives the mean over all ``N`` rows, averaged over the draws."""
    values = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    p = torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    total = 0.0
    for bits in range(16):  # every draw of the four rows, each with probability 1/16
        kept = torch.tensor([i for i in range(4) if bits >> i & 1], dtype=torch.long)
        if kept.numel():
            w = weighted_rows(4, kept, 1 / p[kept], kept=int(kept.numel()))
            total += float((w * values).sum() / kept.numel()) / 16
    assert abs(total - float(values.mean())) < 1e-12
