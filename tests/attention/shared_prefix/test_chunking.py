"""``chunk_plan``: groups split into grids by completion length, never worse than one grid."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.shared_prefix.chunking import chunk_plan
from grpo_parts.attention.shared_prefix.facts import GroupFacts


def _batch(groups: list[int], lengths: list[int], prompt: int = 5) -> LogprobBatch:
    gi = torch.tensor([g for g, k in enumerate(groups) for _ in range(k)])
    n, t = int(gi.numel()), max(lengths)
    clen = torch.tensor([lengths[i % len(lengths)] for i in range(n)])
    cm = (torch.arange(t) < clen.unsqueeze(1)).long()
    ones = torch.ones(n, prompt, dtype=torch.long)
    return LogprobBatch(
        ones,
        ones,
        torch.ones(n, t, dtype=torch.long),
        cm,
        gi[torch.randperm(n, generator=torch.Generator().manual_seed(n))],
    )


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    groups=st.lists(st.integers(1, 8), min_size=1, max_size=12),
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    overhead=st.sampled_from([-1, 0, 64, 1024, 10**9]),
    max_chunks=st.integers(1, 8),
)
def test_plan_partitions_whole_groups_and_never_costs_more(
    groups: list[int], lengths: list[int], overhead: int, max_chunks: int
) -> None:
    batch = _batch(groups, lengths)
    chunks, info = chunk_plan(GroupFacts.of(batch), overhead, max_chunks)
    rows = torch.cat(chunks)
    assert sorted(rows.tolist()) == list(range(batch.group_index.numel()))  # every row exactly once
    owner = {}
    for c, idx in enumerate(chunks):
        for g in batch.group_index[idx].tolist():
            assert owner.setdefault(g, c) == c  # a group is never split across grids
    assert info["chunks"] == len(chunks) <= max(1, min(max_chunks, len(groups)))
    assert info["grid_slots"] <= info["single_grid_slots"]
    if overhead < 0:
        assert len(chunks) == min(max_chunks, len(groups))
    if overhead >= 10**9:
        assert len(chunks) == 1


def test_long_tail_is_split_and_beats_the_repeated_layout() -> None:
    """Uneven groups (what CPPO keeps) and a few long completions: one grid holds more slots than the
    reference's N x (P + S); the plan holds fewer."""
    groups = [1, 6, 2, 1, 3, 1, 5, 2]
    lengths = [40, 60, 280, 50, 45, 70, 55, 65, 35, 90]
    chunks, info = chunk_plan(GroupFacts.of(_batch(groups, lengths, prompt=110)), 1024, 8)
    assert info["single_grid_slots"] > info["repeated_slots"] > info["grid_slots"]
    assert len(chunks) > 1


def test_a_model_sharded_on_one_process_splits_as_usual() -> None:
    """The plan no longer falls back to one grid for a sharded-looking model: on one process there is
    nobody to agree with (no empty calls); several processes agree on the number of model calls
    (test_chunking_ranks.py)."""
    from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
    from grpo_parts.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", vocab_size=16, hidden_size=16, num_layers=1, num_heads=2)
    batch = _batch([2, 1, 3], [3, 9, 1, 6])
    next(model.parameters()).ds_id = 0  # type: ignore[attr-defined]  # what DeepSpeed ZeRO-3 marks
    sharded = SharedPrefixAttention(chunk_overhead_tokens=-1, layout="grid")
    sharded.completion_logprobs(model, batch)
    assert sharded.last_plan["chunks"] == sharded.last_plan["model_calls"] == 3
    assert sharded.last_plan["empty_calls"] == 0
    explicit = SharedPrefixAttention(
        chunk_overhead_tokens=-1, max_chunks=2, layout="grid"
    )  # the user's choice wins
    explicit.completion_logprobs(model, batch)
    assert explicit.last_plan["chunks"] == 2
    plan = sharded.plan(model, batch)
    assert len(plan.calls) == plan.model_calls == 3 and plan.empty_calls == 0
    more = plan.agreed(5)  # what another rank's five grids make this one run
    assert len(more.calls) == 3 and more.empty_calls == 2  # three groups: at most three grids
    assert more.agreed(2).model_calls == 3  # never fewer calls than the plan's own


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 16), min_size=1, max_size=6),
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=40),
    prompts=st.lists(st.integers(1, 1024), min_size=1, max_size=6),
)
def test_split_long_tails_never_exceeds_the_packed_rows(
    sizes: list[int], lengths: list[int], prompts: list[int]
) -> None:
    """Each group's sub-groups hold at most its rows packed, and at most its own one-group layout;
    sub-groups never mix groups."""
    from grpo_parts.attention.shared_prefix.chunking import split_long_tails

    gi = torch.tensor([g for g, k in enumerate(sizes) for _ in range(k)])
    plen = torch.tensor([prompts[g % len(prompts)] for g in gi.tolist()])
    clen = torch.tensor([lengths[i % len(lengths)] for i in range(gi.numel())])
    sub = split_long_tails(gi, plen, clen)
    for g in range(len(sizes)):
        rows = gi == g
        assert len(set(sub[rows].tolist()) & set(sub[~rows].tolist())) == 0
        layout = sum(
            int(plen[sub == s][0]) + int((sub == s).sum()) * int(clen[sub == s].max())
            for s in set(sub[rows].tolist())
        )
        assert layout <= int((plen[rows] + clen[rows]).sum())
        assert layout <= int(plen[rows][0]) + int(rows.sum()) * int(clen[rows].max())
