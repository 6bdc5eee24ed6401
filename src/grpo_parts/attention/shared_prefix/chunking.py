"""Split a batch's groups into a few grids, so that long-tailed completions do not pad every slot.

Rows of different groups never attend to each other, so the groups can run as several forwards with
the same log-probs and gradients. :func:`chunk_plan` cuts the groups, sorted by longest completion,
into at most ``max_chunks`` grids minimising token slots plus ``overhead_tokens`` per extra forward
(a negative overhead forces the split, for tests). Ranks agree on the call count with empty calls
(:meth:`.plan.Plan.agreed`): docs/attention.md, "Several grids when completions are long-tailed".
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import PLAN_CHUNKS, PLAN_GRID_SLOTS, LogprobBatch
from .facts import GroupFacts

#: above this many groups the plan is not searched (one grid): the search is O(chunks x groups^2)
MAX_PLANNED_GROUPS = 1024


def empty_call_batch(batch: LogprobBatch) -> LogprobBatch:
    """A one-token prefix and a one-token completion taken from ``batch``'s first row (real token
    ids, so every embedding lookup is valid): what an *empty call* runs. With images, the first
    row's whole prompt and its images instead, so the vision tower runs in it as in a real call
    (sharded ranks gather its weights once per call)."""
    if batch.vision is not None:
        return LogprobBatch(
            batch.prompt_ids[:1], batch.prompt_mask[:1], batch.completion_ids[:1, :1],
            torch.ones_like(batch.completion_mask[:1, :1]), batch.group_index[:1], batch.vision,
        )  # fmt: skip
    return LogprobBatch(
        batch.completion_ids[:1, :1],  # a text token (right-padded completions: the first is real)
        torch.ones_like(batch.prompt_mask[:1, -1:]),
        batch.completion_ids[:1, :1],
        torch.ones_like(batch.completion_mask[:1, :1]),
        torch.zeros_like(batch.group_index[:1]),
    )


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
    facts: GroupFacts, overhead_tokens: int, max_chunks: int
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """``(row indices of each chunk, on the CPU, info)`` of a batch's :class:`.facts.GroupFacts`; info:
    ``groups``, ``chunks``, ``grid_slots`` (the plan's token slots), ``single_grid_slots`` (one grid),
    ``repeated_slots`` (``N x (P + S)``, what the reference pads to). One chunk when splitting does
    not pay for its extra forwards."""
    row_group, rows, p, s = facts.row_group, facts.rows, facts.prompt, facts.longest
    b, n = rows.numel(), row_group.numel()
    single = float(b * (int(p.max()) + int(rows.max()) * int(s.max()))) if b else 0.0
    info: dict[str, Any] = {
        "groups": b,
        PLAN_CHUNKS: 1,
        PLAN_GRID_SLOTS: single,
        "single_grid_slots": single,
        "repeated_slots": float(n * (int(p.max()) + int(s.max()))) if b else 0.0,
    }
    everything = [torch.arange(n)]
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
    chunks = [torch.nonzero(row_chunk == c).squeeze(1) for c in range(k + 1)]
    info.update({PLAN_CHUNKS: k + 1, PLAN_GRID_SLOTS: float(best[k][-1])})
    return chunks, info


def one_grid_per_group(f: GroupFacts) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """:func:`chunk_plan`'s result with every group its own grid: ``sum(P + rows x longest)`` slots,
    for sub-groups of :func:`split_long_tails` at most the rows packed."""
    _, info = chunk_plan(f, 0, 1)
    chunks = [torch.nonzero(f.row_group == g).squeeze(1) for g in range(int(f.rows.numel()))]
    slots = float((f.prompt + f.rows * f.longest).sum())
    info.update({PLAN_CHUNKS: len(chunks), PLAN_GRID_SLOTS: slots})
    return chunks, info


def grid_calls(
    facts: GroupFacts, overhead_tokens: int, max_chunks: int, packed: bool
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The grids of ``facts`` (:func:`chunk_plan`); ``packed``: where they would hold more tokens than the
    packed rows, split further with no per-forward overhead, and failing that one grid per (sub-)group -- each
    at most its rows packed (:func:`split_long_tails`), so the plan never exceeds them."""
    chunks, info = chunk_plan(facts, overhead_tokens, max_chunks)
    if packed and info[PLAN_GRID_SLOTS] > facts.packed_tokens:
        chunks, info = chunk_plan(facts, 0, max_chunks)
    if packed and info[PLAN_GRID_SLOTS] > facts.packed_tokens:
        chunks, info = one_grid_per_group(facts)
    return chunks, info


#: groups with more rows than this are not split (the split's search is O(rows^2) per group)
MAX_SPLIT_ROWS = 512


def split_long_tails(
    group_index: torch.Tensor, prompt_lens: torch.Tensor, completion_lens: torch.Tensor
) -> torch.Tensor:
    """New ``group_index [N]`` that splits each group into sub-groups of similar completion length,
    so that no group's layout ``[prefix | slot x rows]`` holds more tokens than its rows packed
    (``sum(prompt + completion)``): each group's rows, longest completion first, are cut into
    contiguous runs minimising ``sum(P + rows x longest)`` (a run of one row is its packed length,
    so the minimum never exceeds it). Rows of a sub-group still share the prompt; sub-groups of one
    group encode it once each. Exact (rows of different groups never attend to each other)."""
    gi = group_index.detach().cpu().long()
    plen, clen = prompt_lens.detach().cpu().long(), completion_lens.detach().cpu().long()
    out = torch.empty_like(gi)
    nxt = 0
    for g in torch.unique(gi).tolist():
        members = torch.nonzero(gi == g).squeeze(1)
        order = torch.argsort(clen[members], descending=True, stable=True)
        rows: list[int] = members[order].tolist()
        s: list[int] = clen[members][order].tolist()
        p, k = int(plen[rows[0]]), len(rows)
        if k > MAX_SPLIT_ROWS:
            out[rows] = nxt
            nxt += 1
            continue
        best, cut = [0] * (k + 1), [0] * (k + 1)  # best[j]: least tokens for the first j rows
        for j in range(1, k + 1):
            costs = [best[i] + p + (j - i) * s[i] for i in range(j)]
            cut[j] = costs.index(min(costs))
            best[j] = costs[cut[j]]
        j = k
        while j > 0:
            i = cut[j]
            out[rows[i:j]] = nxt
            nxt += 1
            j = i
    return out.to(group_index.device)
