"""Split a batch's groups into a few grids, so that long-tailed completions do not pad every slot.

One grid (:mod:`.layout`) gives every group ``G`` slots of ``S`` tokens, ``G`` the largest group and
``S`` the longest completion in the batch. With long-tailed completion lengths (most rows finish
early, a few run long) or uneven groups (CPPO keeps 0..G rows of a group), most of that grid is
padding -- it can hold more token slots than the reference's ``N x (P + S)`` rows. Rows of different
groups never attend to each other, so the groups can be split into several grids, each run as its
own forward, with the same log-probs and gradients.

:func:`chunk_plan` sorts the groups by their longest completion and cuts that order into at most
``max_chunks`` contiguous chunks, minimising the grid token slots plus ``overhead_tokens`` per extra
forward (dynamic programming over the cut points, vectorised over the groups). A negative overhead
splits as far as ``max_chunks`` and the number of groups allow (tests use it to force the split).
"""

from __future__ import annotations

from typing import Any

import torch

from .protocol import LogprobBatch

#: above this many groups the plan is not searched (one grid): the search is O(chunks x groups^2)
MAX_PLANNED_GROUPS = 1024


def _group_sizes(batch: LogprobBatch) -> tuple[torch.Tensor, ...]:
    """``(row_group [N], rows [B], prompt length [B], longest completion [B])`` on the CPU."""
    gi = batch.group_index.detach().cpu()
    _, row_group = torch.unique(gi, return_inverse=True)
    b = int(row_group.max()) + 1 if row_group.numel() else 0
    plen = batch.prompt_mask.detach().cpu().long().sum(-1)
    clen = batch.completion_mask.detach().cpu().long().sum(-1)
    rows = torch.bincount(row_group, minlength=b)
    p = torch.zeros(b, dtype=torch.long).scatter_reduce(0, row_group, plen, "amax")
    s = torch.zeros(b, dtype=torch.long).scatter_reduce(0, row_group, clen, "amax")
    return row_group, rows, p, s


def _segment_costs(rows: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``cost[i, j]``: token slots of one grid holding sorted groups ``i..j`` (inf for ``j < i``).
    ``s`` is sorted descending, so the segment's longest completion is ``s[i]``."""
    b = rows.numel()
    cost = torch.full((b, b), float("inf"), dtype=torch.float64)
    for i in range(b):
        g_max = torch.cummax(rows[i:], 0).values.double()
        p_max = torch.cummax(p[i:], 0).values.double()
        count = torch.arange(1, b - i + 1, dtype=torch.float64)
        cost[i, i:] = count * (p_max + g_max * float(s[i]))
    return cost


def chunk_plan(
    batch: LogprobBatch, overhead_tokens: int, max_chunks: int
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """``(row indices of each chunk, info)``; info: ``groups``, ``chunks``, ``grid_slots`` (the plan's
    token slots), ``single_grid_slots`` (one grid), ``repeated_slots`` (``N x (P + S)``, what the
    reference pads to). One chunk when splitting does not pay for its extra forwards."""
    device = batch.group_index.device
    row_group, rows, p, s = _group_sizes(batch)
    b, n = rows.numel(), row_group.numel()
    single = float(b * (int(p.max()) + int(rows.max()) * int(s.max()))) if b else 0.0
    info: dict[str, Any] = {
        "groups": b,
        "chunks": 1,
        "grid_slots": single,
        "single_grid_slots": single,
        "repeated_slots": float(n * (int(p.max()) + int(s.max()))) if b else 0.0,
    }
    everything = [torch.arange(n, device=device)]
    if max_chunks <= 1 or b <= 1 or b > MAX_PLANNED_GROUPS:
        return everything, info
    order = torch.argsort(s * (int(rows.max()) + 1) + rows, descending=True, stable=True)
    cost = _segment_costs(rows[order], p[order], s[order])
    # best[k][j]: least slots for sorted groups 0..j in k + 1 chunks; cut[k][j]: start of the last one
    best, cuts = [cost[0]], [torch.zeros(b, dtype=torch.long)]
    for _ in range(1, min(max_chunks, b)):
        prev = torch.cat([torch.tensor([float("inf")], dtype=torch.float64), best[-1][:-1]])
        total = prev.unsqueeze(1) + cost  # [start i, end j]: chunks before i, then one chunk i..j
        val, arg = total.min(0)
        best.append(val)
        cuts.append(arg)
    k = min(range(len(best)), key=lambda c: float(best[c][-1]) + c * overhead_tokens)
    if k == 0:
        return everything, info
    bounds, j = [], b - 1
    for c in range(k, -1, -1):
        i = int(cuts[c][j]) if c > 0 else 0
        bounds.append((i, j))
        j = i - 1
    group_chunk = torch.empty(b, dtype=torch.long)
    for c, (i, j) in enumerate(reversed(bounds)):
        group_chunk[order[i : j + 1]] = c
    row_chunk = group_chunk[row_group]
    chunks = [torch.nonzero(row_chunk == c).squeeze(1).to(device) for c in range(k + 1)]
    info.update(chunks=k + 1, grid_slots=float(best[k][-1]))
    return chunks, info
