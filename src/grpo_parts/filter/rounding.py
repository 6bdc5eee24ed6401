"""Rounding the kept rows: whole optimizer steps and equal shares per data-parallel rank.

Data parallelism adds arithmetic on the kept *count* (every rank must get as many rows, filling whole
optimizer steps, or the ranks hang or a framework drops the surplus). :func:`round_to_multiple` adds the
best pruned rows or drops the worst kept ones in the filters' priority order
(:func:`grpo_parts.filter._common.priority_order`); :func:`rank_shares` cuts the kept rows into equal
contiguous shares (a prompt's completions stay together for shared-prefix attention). docs/filter.md,
"Several ranks (data parallelism)".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from ..errors import GRPOPartsError
from ..types import ScoredBatch
from ._common import priority_order

__all__ = ["batch_multiple", "rank_shares", "round_kept_rows", "round_to_multiple"]


def batch_multiple(*sizes: int | None) -> int:
    """Least common multiple of the given sizes (``None`` ignored; 1 when none is given)."""
    out = 1
    for s in sizes:
        if s is not None:
            if s < 1:
                raise GRPOPartsError(f"batch multiple: expected sizes >= 1, got {s}")
            out = math.lcm(out, int(s))
    return out


def rank_shares(num_rows: int, world_size: int, field: str = "kept rows") -> list[range]:
    """``world_size`` equal contiguous row ranges covering ``range(num_rows)`` (rank-major);
    refuses a count that does not split evenly (round it first)."""
    if world_size < 1 or num_rows % world_size:
        raise GRPOPartsError(
            f"{field}: expected a multiple of the data-parallel size {world_size}, got {num_rows} rows"
        )
    per = num_rows // world_size
    return [range(r * per, (r + 1) * per) for r in range(world_size)]


def _priority(scored: ScoredBatch, last: torch.Tensor | None) -> torch.Tensor:
    """The filters' priority order, with the rows flagged in ``last`` moved behind all others."""
    order = priority_order(scored)
    if last is None:
        return order
    return order[torch.sort(last.to(order.device)[order].to(torch.int8), stable=True).indices]


def round_to_multiple(
    scored: Sequence[ScoredBatch],
    kept: Sequence[torch.Tensor],
    multiple: int,
    mode: Literal["up", "down"],
    last: Sequence[torch.Tensor] | None = None,
    field: str = "multiple",
) -> tuple[list[torch.Tensor], int]:
    """Make ``sum(len(k) for k in kept)`` a positive multiple of ``multiple`` (``scored[i]`` /
    ``kept[i]``: one refill round's scored rows and the rows kept of it). ``"up"`` adds pruned rows,
    ``"down"`` removes kept rows (adds when fewer than ``multiple`` are kept), in the filters' priority
    order, latest round first; rows flagged in ``last`` (one bool mask per round, e.g. rows with no loss
    token) rank after every other row. Refuses, naming ``field``, when the rounds hold fewer than
    ``multiple`` rows. Returns the new kept lists and the signed change."""
    kept = [k.clone() for k in kept]
    total = sum(int(k.numel()) for k in kept)
    rem = total % multiple
    if rem == 0 and total > 0:
        return kept, 0
    if mode == "down" and total >= multiple:
        need = rem
        for i in reversed(range(len(kept))):
            if need == 0:
                break
            order = _priority(scored[i], None if last is None else last[i])
            rank = torch.argsort(order)  # the inverse permutation: each row's place in ``order``
            k = kept[i]
            worst_first = k[torch.argsort(rank[k], descending=True)]
            n_drop = min(need, int(k.numel()))
            kept[i] = torch.sort(worst_first[n_drop:]).values
            need -= n_drop
        return kept, -rem
    added = need = multiple - rem if total > 0 else multiple
    for i in reversed(range(len(kept))):
        if need == 0:
            break
        order = _priority(scored[i], None if last is None else last[i])
        is_kept = torch.zeros(scored[i].size, dtype=torch.bool, device=order.device)
        is_kept[kept[i]] = True
        take = order[~is_kept[order]][:need]
        kept[i] = torch.sort(torch.cat([kept[i], take])).values
        need -= int(take.numel())
    if need:
        rows = sum(s.size for s in scored)
        raise GRPOPartsError(
            f"{field}: expected at least {multiple} rows rolled out (kept rows are rounded to a "
            f"multiple of {multiple}), got {rows}"
        )
    return kept, added


def round_kept_rows(
    scored: Sequence[ScoredBatch],
    kept: Sequence[torch.Tensor],
    multiple_of: int,
    rounding: Literal["up", "down"] = "up",
    field: str = "multiple_of",
) -> list[torch.Tensor]:
    """Make the *total* kept over refill rounds a multiple of ``multiple_of``: ``"up"`` re-adds the
    best pruned rows, ``"down"`` drops the worst kept ones (filters' priority order, latest round
    first); ``"up"`` rounds down when too few rows were rolled out. Refuses (naming ``field``) when
    no positive multiple can be formed."""
    total = sum(int(k.numel()) for k in kept)
    rows = sum(s.size for s in scored)
    if multiple_of <= 1 or total % multiple_of == 0:  # also 0 kept: the caller decides
        return list(kept)
    up = -(-total // multiple_of) * multiple_of
    mode: Literal["up", "down"] = "up" if rounding == "up" and up <= rows else "down"
    if total < multiple_of and (mode == "down" or multiple_of > rows):
        raise GRPOPartsError(
            f"{field}: the filter kept {total} rows of {rows}; no multiple of {multiple_of} "
            "can be formed (roll out more prompts or lower the multiple)"
        )
    return round_to_multiple(scored, kept, multiple_of, mode, field=field)[0]
