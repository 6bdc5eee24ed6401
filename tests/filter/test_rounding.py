"""Kept-row arithmetic under data parallelism (grpo_parts.filter.rounding): rounding the total of
every refill round to a multiple in the filters' priority order, equal rank shares, refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.core import group_advantages
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter._common import priority_order
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.filter.rounding import batch_multiple, rank_shares, round_kept_rows, round_to_multiple
from grpo_parts.types import ScoredBatch


def scored(rewards: list[float], g: int) -> ScoredBatch:
    r = torch.tensor(rewards, dtype=torch.float64)
    gi = torch.arange(len(rewards) // g).repeat_interleave(g)
    return ScoredBatch(r, group_advantages(r, gi), gi)


def test_batch_multiple_and_rank_shares() -> None:
    assert batch_multiple(None, 1) == 1 and batch_multiple(4, 6, None) == 12
    assert [list(s) for s in rank_shares(6, 2)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(
        GRPOPartsError, match="train.batch_size: expected a multiple of the data-parallel size 2, got 5"
    ):
        rank_shares(5, 2, field="train.batch_size")


@settings(derandomize=True, deadline=None, max_examples=40)
@given(
    rounds=st.lists(
        st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=8, max_size=8), min_size=1, max_size=3
    ),
    k=st.integers(1, 6),
    multiple=st.integers(2, 6),
    rounding=st.sampled_from(["up", "down"]),
)
def test_round_kept_rows_totals_a_multiple_by_priority(rounds, k, multiple, rounding) -> None:  # type: ignore[no-untyped-def]
    batches = [scored(r, 4) for r in rounds]
    filt = TopKAbsAdvantage(k=k)
    kept = [filt.select(b).kept for b in batches]
    total = sum(int(x.numel()) for x in kept)
    rows = sum(b.size for b in batches)
    try:
        out = round_kept_rows(batches, kept, multiple, rounding, field="train.batch_size")
    except GRPOPartsError as e:  # only when no positive multiple can be formed
        assert str(e).startswith("train.batch_size: ") and total % multiple
        assert total < multiple and (rounding == "down" or multiple > rows)
        return
    n = sum(int(x.numel()) for x in out)
    assert n % multiple == 0
    for b, before, after in zip(batches, kept, out):
        a, o = set(before.tolist()), set(after.tolist())
        assert (a <= o) if n >= total else (o <= a)
        order = priority_order(b).tolist()
        rank = {row: i for i, row in enumerate(order)}
        if n > total and o - a:  # added rows: the best pruned ones of that round
            pruned = [r for r in order if r not in a]
            assert sorted(o - a, key=rank.__getitem__) == pruned[: len(o - a)]
        if n < total and a - o:  # dropped rows: the worst kept ones of that round
            worst = sorted(a, key=rank.__getitem__, reverse=True)
            assert sorted(a - o, key=rank.__getitem__, reverse=True) == worst[: len(a - o)]


def test_round_kept_rows_latest_round_first_and_refusals() -> None:
    b1, b2 = scored([0.0, 1.0, 0.0, 1.0], 4), scored([0.0, 0.2, 0.9, 0.4], 4)
    k1, k2 = torch.tensor([0, 1]), torch.tensor([2])
    up = round_kept_rows([b1, b2], [k1, k2], 4, "up")
    assert up[0].tolist() == [0, 1] and len(up[1]) == 2  # restored from the last round
    down = round_kept_rows([b1, b2], [k1, k2], 2, "down")
    assert down[0].tolist() == [0, 1] and down[1].numel() == 0
    with pytest.raises(GRPOPartsError, match="multiple_of: the filter kept 3 rows of 8"):
        round_kept_rows([b1, b2], [k1, k2], 16, "up")
    with pytest.raises(GRPOPartsError, match="steps_per_generation: expected at least 16 rows rolled out"):
        round_to_multiple([b1, b2], [k1, k2], 16, "up", field="steps_per_generation")
