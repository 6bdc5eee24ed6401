"""The decoding primitives (src/grpo_parts/decoding/) on their own, against plain definitions:
the distribution a sampler draws from, draft-tree ancestor sets and right-aligned cache rows.
The samplers' and drafts' suites exercise them in context (tests/sampler, tests/draft)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_parts.decoding import SamplingParams, right_align, sampling_probs, tree_ancestors


@given(
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_k=st.integers(0, 6),
    top_p=st.sampled_from([0.3, 0.9, 1.0]),
    seed=st.integers(0, 100),
)
def test_sampling_probs_is_the_filtered_softmax(
    temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = sampling_probs(logits, params)
    torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=p.dtype))
    if temperature == 0.0:  # greedy: one-hot at the argmax
        assert torch.equal(p.argmax(-1), logits.argmax(-1)) and bool((p.max(-1).values == 1).all())
        return
    base = torch.softmax(logits / temperature, -1)
    kept = p > 0
    assert bool(kept.gather(-1, logits.argmax(-1, keepdim=True)).all())  # the mode always survives
    if top_k:
        assert bool((kept.sum(-1) <= top_k).all())
    # among the kept tokens, the ratios are the tempered softmax's
    ratio = torch.where(kept, p / base, torch.nan)
    for row in ratio:
        vals = row[~row.isnan()]
        torch.testing.assert_close(vals, vals[:1].expand_as(vals))


def test_tree_ancestors_walk_to_the_root() -> None:
    # root (column 0) -> node 0 -> node 1; root -> node 2
    anc = tree_ancestors(torch.tensor([[-1, 0, -1]]))[0]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(anc, expected)


def test_right_align_moves_each_row_to_end_at_the_width() -> None:
    buf = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0]])
    out = right_align(buf, torch.tensor([2, 3]), 4, -1)
    assert out.tolist() == [[-1, -1, 1, 2], [-1, 3, 4, 5]]
