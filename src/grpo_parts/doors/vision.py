"""A framework's image rows as grpo_parts' groups: frameworks hand the processor's outputs once per
row (TRL repeats each prompt ``num_generations`` times before it runs the processor), flat over
the batch's images; the parts want each prompt's images once, indexed by ``group_index``
(:class:`~grpo_parts.types.VisionInputs`). Rows share a group when their prompt tokens *and* their
images are equal: two dataset rows with one text and different images are two groups."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..types import VisionInputs

__all__ = ["image_groups", "same_images"]


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
            (k for k in by_text.get(g, []) if same_images(rows.per_prompt[reps[k]], rows.per_prompt[i])),
            None,
        )
        if found is None:
            found = len(reps)
            reps.append(i)
            by_text.setdefault(g, []).append(found)
        out.append(found)
    index = torch.tensor(out, dtype=torch.long, device=group.device)
    return index, VisionInputs(tuple(rows.per_prompt[r] for r in reps))
