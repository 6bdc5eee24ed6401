"""Shared strategies and fakes for the filter tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from grpo_parts.core import group_advantages
from grpo_parts.types import Rollout, ScoredBatch


@st.composite
def scored_batches(draw, max_groups: int = 6, max_g: int = 8, min_g: int = 1, discrete: bool | None = None):
    """A ScoredBatch with groups of varying size, shuffled rows, rewards either from a small discrete
    set (many ties and zero-variance groups) or continuous (distinct, non-zero advantages)."""
    n_groups = draw(st.integers(1, max_groups))
    sizes = [draw(st.integers(min_g, max_g)) for _ in range(n_groups)]
    if discrete is None:
        discrete = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    gi = torch.cat([torch.full((s,), g, dtype=torch.long) for g, s in enumerate(sizes)])
    n = int(gi.numel())
    if discrete:
        rewards = torch.randint(0, 3, (n,), generator=gen).double() / 2
    else:
        rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    perm = torch.randperm(n, generator=gen) if draw(st.booleans()) else torch.arange(n)
    gi, rewards = gi[perm], rewards[perm]
    adv = group_advantages(rewards, gi)
    return ScoredBatch(rewards, adv, gi)


def fake_rollout(prompts: list[int], group_size: int, vocab: int = 50, max_t: int = 7) -> Rollout:
    """A deterministic Rollout for integer prompts: prompt p has length 2 + p % 4, completions have
    random lengths in [1, max_t], all seeded by the prompt id."""
    n, pw = len(prompts) * group_size, 2 + max(p % 4 for p in prompts)
    pi = torch.zeros(n, pw, dtype=torch.long)
    pm = torch.zeros(n, pw, dtype=torch.long)
    ci = torch.zeros(n, max_t, dtype=torch.long)
    lengths = torch.zeros(n, dtype=torch.long)
    for b, p in enumerate(prompts):
        gen = torch.Generator().manual_seed(1000 + p)
        rows = slice(b * group_size, (b + 1) * group_size)
        length = 2 + p % 4
        pi[rows, pw - length :] = torch.randint(1, vocab, (length,), generator=gen)
        pm[rows, pw - length :] = 1
        ci[rows] = torch.randint(1, vocab, (group_size, max_t), generator=gen)
        lengths[rows] = torch.randint(1, max_t + 1, (group_size,), generator=gen)
    cm = (torch.arange(max_t) < lengths[:, None]).long()
    ci = ci * cm
    lp = (
        -torch.rand(n, max_t, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(prompts))) * cm
    )
    gi = torch.arange(len(prompts)).repeat_interleave(group_size)
    return Rollout(pi, pm, ci, cm, lp, gi, len(prompts))


def fake_reward(prompts: list[int], rollout: Rollout) -> torch.Tensor:
    """Prompts divisible by 3 get the same reward for every completion (zero-variance group); the
    others get rewards in [0, 1) that depend only on the prompt and the completion's tokens."""
    p = torch.tensor(prompts, dtype=torch.long)[rollout.group_index]
    t = rollout.completion_ids.shape[1]
    ids = rollout.completion_ids * rollout.completion_mask.long()
    h = (ids * (torch.arange(t) * 131 + 7919)).sum(-1) + p * 31
    r = (h % 100003).double() / 100003
    return torch.where(p % 3 == 0, torch.ones_like(r), r)
