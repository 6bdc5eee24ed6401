"""Sampled draft trees: the fixed shape, Gumbel-top-w draws (sequential draws without replacement,
chi-square), and which drafts propose them (sampled under sampling, top-K when greedy)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from grpo_parts.decoding import SamplingParams
from grpo_parts.draft.eagle import EagleConfig, EagleDraft
from grpo_parts.draft.protocol import DraftContext, TreeBudget
from grpo_parts.draft.small_lm import CachedLMDraft
from grpo_parts.draft.tree_sampled import draw_without_replacement, tree_shape
from grpo_parts.testing import chi_square_gof
from grpo_parts.tiny import tiny_causal_lm


def test_shape_is_fixed_by_the_budget() -> None:
    """Breadth-first, parents first, siblings in draw order, within depth and width; a chain when
    the width is 1."""
    assert tree_shape(TreeBudget(3, 3, 1), 10) == ([-1, 0, 1], [1, 2, 3])
    parents, depths = tree_shape(TreeBudget(32, 5, 8), 10)
    assert len(parents) == 32 and max(depths) == 5
    assert all(p < i for i, p in enumerate(parents)) and depths == sorted(depths)
    assert max(parents.count(p) for p in set(parents)) <= 8
    assert len(tree_shape(TreeBudget(32, 5, 8), 2)[0]) == 32  # width capped by the vocabulary
    assert max(tree_shape(TreeBudget(32, 5, 8), 2)[0].count(p) for p in range(-1, 31)) <= 2


def test_gumbel_top_w_is_sequential_sampling_without_replacement() -> None:
    q = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0], dtype=torch.float64)
    n = 20000
    drawn = draw_without_replacement(q.expand(n, -1), 2, torch.Generator().manual_seed(0))
    pairs = list(itertools.permutations(range(4), 2))
    exact = np.array([float(q[a] * q[b] / (1 - q[a])) for a, b in pairs])
    index = {pr: i for i, pr in enumerate(pairs)}
    codes = [index[(int(a), int(b))] for a, b in drawn.tolist()]
    assert chi_square_gof(codes, exact) > 1e-4


def _ctx(policy: torch.nn.Module) -> DraftContext:
    tokens = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    h = policy(input_ids=tokens, output_hidden_states=True).hidden_states[-1]
    return DraftContext(
        tokens,
        torch.tensor([4, 4]),
        torch.tensor([0, 1]),
        torch.tensor([0, 1]),
        h[:, -1],
        h,
        torch.tensor([4, 4]),
    )


@pytest.mark.parametrize("draft", ["eagle", "small_lm"])
def test_model_drafts_sample_their_trees(draft: str) -> None:
    policy = tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1, seed=0)
    budget = TreeBudget(8, 3, 4)
    for temp, sampled in [(1.0, True), (0.0, False)]:
        params = SamplingParams(group_size=1, max_new_tokens=4, temperature=temp)
        d = (
            EagleDraft(policy)
            if draft == "eagle"
            else CachedLMDraft(tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1, seed=1))
        )
        d.reset(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), torch.tensor([0, 1]))
        prop = d.propose_tree(_ctx(policy), budget, params, torch.Generator().manual_seed(0))
        assert prop.sampled == sampled and prop.tokens.shape == (2, 8)
        if sampled:  # siblings distinct (drawn without replacement); probs = q at the parent
            par = prop.chain_parents()[0].tolist()
            for p in set(par):
                sib = [int(prop.tokens[0, i]) for i in range(8) if par[i] == p]
                assert len(set(sib)) == len(sib)
                same = [i for i in range(8) if par[i] == p]
                assert all(torch.equal(prop.probs[:, same[0]], prop.probs[:, i]) for i in same)
    off = EagleDraft(policy, EagleConfig(sampled_trees=False))
    prop = off.propose_tree(_ctx(policy), budget, SamplingParams(group_size=1, max_new_tokens=4))
    assert not prop.sampled
