"""A vision-language batch's grid: each prompt's images once per grid row, and the positions its
tokens had when sampled (:func:`grpo_parts.attention.vision.row_positions`).

A grid row holds one prompt, real tokens first, then its completions' slots. Each slot's 1-D
position already counts from the prompt's end; M-RoPE adds the prompt's delta to it, as
generation does for the text after an image, and the prompt's own columns take the model's 3-D
positions. docs/attention.md, "Vision-language policies".
"""

from __future__ import annotations

import torch

from ..protocol import LogprobBatch
from ..vision import row_positions
from .layout import GroupedInputs


def grid_images(
    model: torch.nn.Module, batch: LogprobBatch, grouped: GroupedInputs
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(image keywords, position_ids)`` for ``grouped`` (built from ``batch``): the images of
    each grid row's prompt, in grid-row order, and the grid's positions (``[3, B, L]`` for M-RoPE,
    else ``grouped.position_ids``)."""
    assert batch.vision is not None
    groups = torch.unique(batch.group_index).tolist()  # grid row r holds the r-th group, ascending
    images = batch.vision.gather(groups)
    pw, valid = grouped.layout.prefix_len, grouped.layout.prefix_valid
    if valid is None:
        valid = torch.ones_like(grouped.input_ids[:, :pw], dtype=torch.bool)
    prefix_pos, deltas = row_positions(model, grouped.input_ids[:, :pw], valid, images)
    if prefix_pos.ndim == 2:  # 1-D positions: the grid's own
        return images, grouped.position_ids
    pos = (grouped.position_ids + deltas).unsqueeze(0).expand(prefix_pos.shape[0], -1, -1).clone()
    pos[:, :, :pw] = torch.where(valid, prefix_pos, pos[:, :, :pw])
    return images, pos
