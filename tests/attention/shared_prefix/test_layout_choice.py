"""``layout="auto"`` by estimated cost (``attention/shared_prefix/layout_choice.py``): model tokens plus attention
scores weighed by FLOPs. The varlen plan (the ``sdpa`` cascade, its ``eager`` equivalent) never
computes more scores than the grid under the same kernel, so fewer tokens decide; under a dense
per-span mask (``varlen=False``) the grid's cascade can win
although the padding-free layout runs fewer tokens. The choice and its reason are recorded, and
either layout is exact (float64, live reference)."""

from __future__ import annotations

import torch
from _attention_helpers import exact_model, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shared_prefix import assert_equivalent

from grpo_parts.attention import LogprobBatch
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.chunking import chunk_plan
from grpo_parts.attention.shared_prefix.facts import GroupFacts
from grpo_parts.attention.shared_prefix.layout_choice import (
    LayoutCost,
    choose_layout,
    grid_cost,
    padding_free_cost,
    score_weight,
)


def test_choose_layout_weighs_scores_against_tokens():  # type: ignore[no-untyped-def]
    grid, free = LayoutCost(170, 2_000), LayoutCost(163, 27_000)
    assert choose_layout("auto", grid, free)[0] == "padding_free"  # no weight: tokens alone
    layout, why = choose_layout("auto", grid, free, 0.01)
    assert layout == "grid" and why.startswith("grid: cost 190 (170 model tokens + 0.01 x")
    assert choose_layout("auto", grid, LayoutCost(163, 2_000), 0.01)[0] == "padding_free"
    assert choose_layout("auto", LayoutCost(10, 5), LayoutCost(10, 5), 1.0)[0] == "grid"  # a tie
    assert choose_layout("padding_free", grid, free, 0.01) == (
        "padding_free",
        "layout 'padding_free' (requested)",
    )


def test_score_weight_from_the_config():  # type: ignore[no-untyped-def]
    model = exact_model("llama", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=1)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    weights = 32 * d * (2 * 4 + 2 * 2) + 3 * 32 * cfg.intermediate_size
    assert score_weight(cfg) == 4 * 4 * d / (2 * weights)
    assert score_weight(object()) == 0.0  # no sizes: tokens alone


@st.composite
def batches(draw):  # type: ignore[no-untyped-def]
    groups = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return random_batch(
        gen, groups, vocab=48, max_prompt=draw(st.integers(1, 30)), max_completion=draw(st.integers(1, 60))
    )


@settings(max_examples=50, derandomize=True, deadline=None)
@given(batch=batches())
def test_varlen_never_costs_more_than_the_grid(batch):  # type: ignore[no-untyped-def]
    """Every grid plan pads each completion to at least its own length: the varlen plan's scores and
    tokens are at most the grid's (per kernel), so with it the cost choice is the token choice."""
    facts = GroupFacts.of(batch)
    chunks, info = chunk_plan(facts, 0, 8)
    for eager in (False, True):  # eager: whole squares on both sides
        grid = grid_cost(facts, chunks, info["grid_slots"], eager)
        free = padding_free_cost(facts, dense=False, eager=eager)
        assert free.tokens == GroupFacts.of(batch).padding_free_tokens <= grid.tokens
        assert free.scores <= grid.scores + 1e-9


def _near_uniform() -> LogprobBatch:
    """One group of 8 completions of 20 tokens and one of 21 after a 2-token prompt: the grid pads 7
    tokens, while a dense mask over the padding-free span costs 163^2 scores against the grid's ~2.2k."""
    n, t = 8, 21
    cm = torch.zeros(n, t, dtype=torch.long)
    cm[:, :20] = 1
    cm[0, 20] = 1
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 48, (n, t), generator=gen)
    prompt = torch.randint(1, 48, (1, 2), generator=gen).expand(n, 2).clone()
    return LogprobBatch(prompt, torch.ones(n, 2, dtype=torch.long), ids, cm, torch.zeros(n, dtype=torch.long))


def test_a_dense_mask_keeps_the_grid_the_varlen_cascade_takes_padding_free():  # type: ignore[no-untyped-def]
    model = exact_model("llama", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=1)
    batch = _near_uniform()
    assert GroupFacts.of(batch).padding_free_tokens == 163
    for kernel, options, expected in (
        ("sdpa", {}, "padding_free"),
        ("sdpa", {"varlen": False}, "grid"),
        ("eager", {}, "padding_free"),  # its varlen plan: whole squares, as the grid's eager
        ("eager", {"varlen": False}, "grid"),
    ):
        backend = SharedPrefixAttention(kernel, **options)
        backend.completion_logprobs(model, batch)
        plan = backend.last_plan
        assert plan["layout"] == expected, plan["layout_choice"]
        assert plan["layout_choice"].startswith(f"{expected}: cost ")
        assert bool(plan["attention_calls"]) == (expected == "padding_free")
        assert_equivalent(model, batch, kernel, **options)
