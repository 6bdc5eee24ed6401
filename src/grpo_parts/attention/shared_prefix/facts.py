"""The facts of a batch that every planning decision reads, read from the device once.

:class:`GroupFacts` holds per-row and per-group lengths on the CPU; the grid split
(:mod:`.chunking`), the layout costs (:mod:`.layout_choice`) and the plan (:mod:`.plan`) read them
instead of the batch's tensors, so a call syncs with the device once however many decisions it makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protocol import LogprobBatch


@dataclass(frozen=True)
class GroupFacts:
    """What planning reads from a batch, on the CPU: ``row_group: [N]`` (groups numbered ``0..B-1``
    in ascending ``group_index``), ``prompt_row, completion: [N]`` (real tokens of each row), per
    group ``rows, prompt, longest: [B]`` (its rows, its prompt length, its longest completion), and
    the token counts every decision reads: ``packed_tokens`` (every row's prompt and completion back
    to back, what a packed forward runs), ``padding_free_tokens`` (each group's prompt once plus
    every completion token: the padding-free layout without the one padding column it may add) and
    ``max_span`` (the longest row, prompt plus completion: the reference's largest position id + 1)."""

    row_group: torch.Tensor
    prompt_row: torch.Tensor
    completion: torch.Tensor
    rows: torch.Tensor
    prompt: torch.Tensor
    longest: torch.Tensor
    packed_tokens: int
    padding_free_tokens: int
    max_span: int

    @staticmethod
    def of(batch: LogprobBatch) -> GroupFacts:
        """The facts of ``batch`` in one device-to-host copy."""
        cols = torch.stack(
            [batch.group_index.long(), batch.prompt_mask.long().sum(-1), batch.completion_mask.long().sum(-1)]
        ).cpu()
        return GroupFacts.from_rows(cols[0], cols[1], cols[2])

    @staticmethod
    def from_rows(
        group_index: torch.Tensor, prompt_row: torch.Tensor, completion: torch.Tensor
    ) -> GroupFacts:
        """Facts from per-row CPU tensors ``[N]``."""
        _, row_group = torch.unique(group_index, return_inverse=True)
        b = int(row_group.max()) + 1 if row_group.numel() else 0
        zeros = torch.zeros(b, dtype=torch.long)
        prompt = zeros.scatter_reduce(0, row_group, prompt_row, "amax")
        return GroupFacts(
            row_group,
            prompt_row,
            completion,
            torch.bincount(row_group, minlength=b),
            prompt,
            zeros.scatter_reduce(0, row_group, completion, "amax"),
            int(prompt_row.sum() + completion.sum()),
            int(prompt.sum() + completion.sum()),
            int((prompt_row + completion).max()) if completion.numel() else 0,
        )
