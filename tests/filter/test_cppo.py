"""CPPO top-k by |advantage|: the kept set against a brute-force sort, scopes, validation."""

from __future__ import annotations

import math

import pytest
import torch
from filter_fakes import scored_batches
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_parts.filter import get_filter_class
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.filter.reference import KeepAll
from grpo_parts.types import ScoredBatch


def brute_force(batch: ScoredBatch, f: TopKAbsAdvantage) -> list[int]:
    """The documented rule, written plainly with Python's sorted()."""
    r, a, g = batch.rewards.tolist(), batch.advantages.tolist(), batch.group_index.tolist()
    n = len(r)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(g[i], []).append(i)
    zv = {i: len(groups[g[i]]) == 1 or len({r[j] for j in groups[g[i]]}) == 1 for i in range(n)}
    ok = {i: (not f.drop_zero_advantage) or (not zv[i] and a[i] != 0) for i in range(n)}

    def key(i: int) -> tuple[bool, float, int]:
        return (zv[i], -abs(a[i]), i)

    kept: set[int] = set()
    if f.scope == "group":
        for rows in groups.values():
            q = f.k if f.k is not None else len(rows) - math.floor(f.pruning_rate * len(rows) + 1e-9)
            q = max(q, f.min_per_group)
            kept |= {i for i in sorted(rows, key=key)[:q] if ok[i]}
    else:
        total = f.k if f.k is not None else n - math.floor(f.pruning_rate * n + 1e-9)
        for rows in groups.values():
            kept |= {i for i in sorted(rows, key=key)[: f.min_per_group] if ok[i]}
        rest = [i for i in sorted(range(n), key=key) if ok[i] and i not in kept]
        kept |= set(rest[: max(0, total - len(kept))])
    return sorted(kept)


filters = st.builds(
    lambda use_k, k, p, scope, m, drop: TopKAbsAdvantage(
        k=k if use_k else None,
        pruning_rate=None if use_k else p,
        scope=scope,
        min_per_group=min(m, k) if (use_k and scope == "group") else m,
        drop_zero_advantage=drop,
    ),
    st.booleans(),
    st.integers(1, 12),
    st.sampled_from([0.0, 0.25, 0.5, 0.6, 0.75, 0.875, 0.9375]),
    st.sampled_from(["global", "group"]),
    st.integers(0, 2),
    st.booleans(),
)


@given(scored_batches(), filters)
def test_kept_set_is_brute_force_top_k(batch: ScoredBatch, f: TopKAbsAdvantage) -> None:
    res = f.select(batch)
    assert res.kept.tolist() == brute_force(batch, f)
    assert res.info["num_kept"] == res.kept.numel()


@given(scored_batches(min_g=2, discrete=False))
def test_k_equals_group_size_is_keep_all(batch: ScoredBatch) -> None:
    g_max = int(torch.bincount(batch.group_index).max())
    all_rows = KeepAll().select(batch).kept
    assert torch.equal(TopKAbsAdvantage(k=g_max, scope="group").select(batch).kept, all_rows)
    assert torch.equal(TopKAbsAdvantage(pruning_rate=0.0).select(batch).kept, all_rows)
    assert torch.equal(TopKAbsAdvantage(k=batch.size).select(batch).kept, all_rows)


@given(scored_batches(discrete=True))
def test_k_equals_group_size_keeps_all_without_zero_drop(batch: ScoredBatch) -> None:
    g_max = int(torch.bincount(batch.group_index).max())
    f = TopKAbsAdvantage(k=g_max, scope="group", drop_zero_advantage=False)
    assert torch.equal(f.select(batch).kept, KeepAll().select(batch).kept)


@given(scored_batches(discrete=True), st.integers(1, 40), st.booleans())
def test_zero_variance_groups_pruned_first(batch: ScoredBatch, k: int, drop: bool) -> None:
    from grpo_parts.filter._common import zero_variance_rows

    zv = zero_variance_rows(batch)
    kept = TopKAbsAdvantage(k=k, drop_zero_advantage=drop).select(batch).kept
    kept_mask = torch.zeros(batch.size, dtype=torch.bool)
    kept_mask[kept] = True
    if drop:
        assert not bool((kept_mask & zv).any())
    if bool((kept_mask & zv).any()):  # a zero-variance row is only kept once every other row is
        assert bool(kept_mask[~zv].all())


def test_zero_variance_decided_on_rewards_not_on_rounded_advantages() -> None:
    # A framework whose advantages for an all-equal group are rounding noise (1e-17) instead of 0.
    r = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.0], dtype=torch.float64)
    a = torch.tensor([1e-17, -1e-17, 1e-17, -0.5, 1.0, -0.5], dtype=torch.float64)
    gi = torch.tensor([0, 0, 0, 1, 1, 1])
    kept = TopKAbsAdvantage(k=6, drop_zero_advantage=False).select(ScoredBatch(r, a, gi)).kept
    assert kept.tolist() == [0, 1, 2, 3, 4, 5]
    assert TopKAbsAdvantage(k=4).select(ScoredBatch(r, a, gi)).kept.tolist() == [3, 4, 5]


def test_tie_rule_lower_row_first() -> None:
    r = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    gi = torch.tensor([0, 0, 0, 0])
    a = torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    assert TopKAbsAdvantage(k=3).select(ScoredBatch(r, a, gi)).kept.tolist() == [0, 1, 2]


def test_global_vs_group_scope_differ() -> None:
    # group 0 has extreme advantages, group 1 mild ones: global keeps group 0 only.
    r = torch.tensor([0.0, 10.0, 0.0, 10.0, 0.0, 1.0, 0.5, 0.6], dtype=torch.float64)
    a = torch.tensor([-3.0, 3.0, -3.0, 3.0, -0.5, 0.5, 0.1, 0.2], dtype=torch.float64)
    gi = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    b = ScoredBatch(r, a, gi)
    assert TopKAbsAdvantage(pruning_rate=0.5).select(b).kept.tolist() == [0, 1, 2, 3]
    assert TopKAbsAdvantage(pruning_rate=0.5, scope="group").select(b).kept.tolist() == [0, 1, 4, 5]
    assert TopKAbsAdvantage(pruning_rate=0.5, min_per_group=1).select(b).kept.tolist() == [0, 1, 2, 4]


def test_all_zero_advantages_give_empty_result() -> None:
    r = torch.ones(8, dtype=torch.float64)
    b = ScoredBatch(r, torch.zeros(8, dtype=torch.float64), torch.arange(8) // 4)
    res = TopKAbsAdvantage(pruning_rate=0.5).select(b, target_size=8)
    assert res.is_empty and res.extra_prompts_wanted == 4  # nominal yield (1 - P) * G = 2 per prompt


def test_extra_prompts_wanted_is_ceil_deficit_over_yield() -> None:
    r = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gi = torch.arange(16) // 4
    from grpo_parts.core import group_advantages

    b = ScoredBatch(r, group_advantages(r, gi), gi)
    res = TopKAbsAdvantage(pruning_rate=0.75).select(b, target_size=16)
    assert res.kept.numel() == 4 and res.extra_prompts_wanted == 12  # ceil(12 / (4 / 4))
    assert TopKAbsAdvantage(pruning_rate=0.75).select(b).extra_prompts_wanted == 0
    assert TopKAbsAdvantage(pruning_rate=0.75).select(b, target_size=3).extra_prompts_wanted == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "k / pruning_rate"),
        ({"k": 2, "pruning_rate": 0.5}, "k / pruning_rate"),
        ({"pruning_rate": 1.0}, "pruning_rate"),
        ({"pruning_rate": -0.1}, "pruning_rate"),
        ({"k": 0}, "k"),
        ({"k": 2, "scope": "row"}, "scope"),
        ({"k": 2, "min_per_group": -1}, "min_per_group"),
        ({"k": 2, "scope": "group", "min_per_group": 3}, "min_per_group"),
    ],
)
def test_config_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field.split()[0]):
        TopKAbsAdvantage(**kwargs)


def test_registry_names() -> None:
    assert get_filter_class("cppo") is TopKAbsAdvantage
    assert get_filter_class("zero_variance").name == "zero_variance"
    assert get_filter_class("pods").name == "pods"
    assert (
        TopKAbsAdvantage(k=1).not_supported_reasons(
            ScoredBatch(*(torch.zeros(0),) * 2, torch.zeros(0, dtype=torch.long))
        )
        == []
    )


def test_empty_batch() -> None:
    b = ScoredBatch(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert TopKAbsAdvantage(k=3).select(b, target_size=4).is_empty
