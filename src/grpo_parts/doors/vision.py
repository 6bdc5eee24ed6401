"""A framework's image rows as grpo_parts' groups: frameworks hand the processor's outputs once per
row (TRL repeats each prompt ``num_generations`` times before it runs the processor), flat over
the batch's images; the parts want each prompt's images once, indexed by ``group_index``
(:class:`~grpo_parts.types.VisionInputs`). Rows share a group when their prompt tokens *and* their
images are equal: two dataset rows with one text and different images are two groups."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..types import VisionInputs

__all__ = ["image_groups", "images_per_row", "same_images"]


def same_images(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two prompts' vision inputs are the same images (same keys, equal tensors)."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and bool(torch.equal(a[k], b[k].to(a[k].device))) for k in a
    )


def image_groups(group: torch.Tensor, rows: VisionInputs) -> tuple[torch.Tensor, VisionInputs]:
    """``(group_index: [N], vision)``: the text groups ``group: [N]`` split where rows carry
    different images (``rows``: one entry per row), numbered in first-seen order, and each new
    group's images once (``vision.per_prompt[g]``)."""
    reps: list[int] = []  # a representative row per new group
    by_text: dict[int, list[int]] = {}  # text group -> its new groups
    out = []
    for i, g in enumerate(group.tolist()):
        found = next(
            (k for k in by_text.get(g, []) if same_images(rows.per_prompt[reps[k]], rows.per_prompt[i])), None
        )
        if found is None:
            found = len(reps)
            reps.append(i)
            by_text.setdefault(g, []).append(found)
        out.append(found)
    index = torch.tensor(out, dtype=torch.long, device=group.device)
    return index, VisionInputs(tuple(rows.per_prompt[r] for r in reps))


def images_per_row(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, fields: Mapping[str, Any]
) -> list[int]:
    """How many of a batch's flat images each row of ``ids: [N, L]`` holds, for frameworks that
    merge their samples' images without a count per row (OpenRLHF). The model takes the images in
    order, each filling as many of the rows' image tokens as its grid makes (``t*h*w`` over the
    merged patches) or, without grids, an equal share; rows are walked the same way. Refused with
    one line where the tokens and the images do not add up."""
    from ..attention.vision import GRID_KEYS
    from ..errors import GRPOPartsError

    cfg: Any = model.config
    token = getattr(cfg, "image_token_id", None)
    token = getattr(cfg, "image_token_index", None) if token is None else token
    per_row = (
        ((ids == int(token)) & mask.bool()).sum(-1).tolist() if token is not None else [0] * ids.shape[0]
    )
    grid = fields.get(GRID_KEYS[0])
    if grid is not None:
        merge = int(getattr(cfg.vision_config, "spatial_merge_size", 1)) ** 2
        sizes = (torch.as_tensor(grid).prod(-1) // merge).tolist()
    else:
        pixels = fields.get("pixel_values")
        n = 0 if pixels is None else int(torch.as_tensor(pixels).shape[0])
        each = sum(per_row) // n if n else 0
        sizes = [each] * n
    counts, k = [], 0
    for r, want in enumerate(per_row):
        got, start = 0, k
        while got < want and k < len(sizes):
            got, k = got + int(sizes[k]), k + 1
        if got != want:
            raise GRPOPartsError(
                f"pixel_values: row {r} holds {want} image tokens, its images in order make {got}: the "
                "batch's images do not follow its rows"
            )
        counts.append(k - start)
    if k != len(sizes):
        raise GRPOPartsError(f"pixel_values: {len(sizes)} images for {k} the rows' image tokens take")
    return counts
