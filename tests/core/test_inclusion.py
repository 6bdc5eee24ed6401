"""core/inclusion.py: the inclusion probabilities a target and a floor give, and systematic sampling
against the exact enumeration of its outcomes (tests/skip_outcomes.py, written independently of it)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from skip_outcomes import systematic_outcomes

from grpo_parts.core.inclusion import inclusion_probabilities, systematic_sample


def test_inclusion_probabilities_edge_cases() -> None:
    s = torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert inclusion_probabilities(s, 4.0, 0.1).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert inclusion_probabilities(s, 0.2, 0.1).tolist() == pytest.approx([0.1] * 4)
    # positive rows capped, the score-0 rows share the rest
    assert inclusion_probabilities(s, 3.0, 0.1).tolist() == pytest.approx([1.0, 1.0, 0.5, 0.5])
    p = inclusion_probabilities(s, 1.5, 0.1)
    assert p.tolist() == pytest.approx([0.975, 0.325, 0.1, 0.1]) and float(p.sum()) == pytest.approx(1.5)


def test_systematic_sample_matches_the_enumeration_for_any_sum() -> None:
    """Not only for an integer sum: the kept count is floor(S) or ceil(S), each prompt kept with p_i."""
    from scipy import stats

    p = torch.tensor([0.3, 0.9, 1.0, 0.45], dtype=torch.float64)  # S = 2.65
    exact = systematic_outcomes(p.tolist())
    gen = torch.Generator().manual_seed(0)
    m = 4000
    seen = Counter(frozenset(systematic_sample(p, gen).nonzero().flatten().tolist()) for _ in range(m))
    assert {len(s) for s in seen} == {2, 3} and set(seen) <= set(exact)
    keys = sorted(exact, key=sorted)
    assert stats.chisquare([seen.get(k, 0) for k in keys], [m * exact[k] for k in keys]).pvalue > 1e-3
