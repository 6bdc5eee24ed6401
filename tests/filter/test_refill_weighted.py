"""The refill with a weighted filter (``dppo``): one round, untrimmed, the weights carried to the
kept batch, and the whole rolled-out batch's loss denominators (pruned rows included)."""

from __future__ import annotations

import itertools

import torch
from filter_fakes import fake_reward, fake_rollout

from grpo_parts.core import group_advantages
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.filter.dppo import DPPOFilter
from grpo_parts.filter.refill import Refiller, fill_rollouts
from grpo_parts.types import ScoredBatch

G = 8


def _fill(filt, target: int, initial: int, rounds: int = 4):
    rolled = []

    def sample(ps):
        rolled.append(fake_rollout(ps, G))
        return rolled[-1]

    out = fill_rollouts(filt, Refiller(target_size=target, initial_prompts=initial, max_rounds=rounds),
                        itertools.count(1), sample, fake_reward)  # fmt: skip
    return out, rolled


def test_a_weighted_draw_is_one_round_untrimmed_with_its_weights_and_full_counts() -> None:
    filt = DPPOFilter(pruning_rate=0.75, seed=1)
    out, rolled = _fill(filt, target=4 * G, initial=4)  # 4 prompts keep ~8 rows: short of 32
    assert out.outcome.rounds == 1 and len(rolled) == 1  # no refill after a random draw
    assert not out.outcome.filled and out.rollout is not None
    ro = rolled[0]
    again = DPPOFilter(pruning_rate=0.75, seed=1)  # the same draw, by hand
    r = fake_reward(list(range(1, 5)), ro)
    res = again.select(ScoredBatch(r, group_advantages(r, ro.group_index), ro.group_index))
    assert out.outcome.num_kept == res.kept.numel() == out.rollout.num_completions
    assert out.weights is not None
    torch.testing.assert_close(out.weights, res.weights.to(out.weights.dtype))
    # the loss denominators of every rolled-out row, and each kept row's rolled-out prompt
    assert out.num_tokens == float(ro.completion_mask.sum())
    assert out.num_seqs == float((ro.completion_mask.sum(-1) > 0).sum())
    assert out.full_group is not None and torch.equal(out.full_group.cpu(), ro.group_index[res.kept].cpu())
    assert torch.equal(
        out.kept.cpu(), res.kept.cpu()
    )  # rows of the rolled-out batch, as apply_filter gives them
    assert out.group_rows is not None and out.group_rows.tolist() == [float(G)] * 4


def test_plain_filters_are_unchanged_and_count_every_round() -> None:
    out, rolled = _fill(TopKAbsAdvantage(pruning_rate=0.5), target=2 * G, initial=2)
    assert out.weights is None and out.outcome.filled and out.outcome.rounds == len(rolled) >= 2
    # a KeptBatch: a plain filter's denominators are the kept rows' own; the rolled-out batch's
    # counts stay per prompt (group_tokens) for a weighted filter's minibatches
    assert out.rollout is not None and out.num_tokens == float(out.rollout.completion_mask.sum())
    assert out.group_tokens is not None and float(out.group_tokens.sum()) == sum(
        int(r.completion_mask.sum()) for r in rolled
    )
    assert out.kept.numel() == out.rollout.num_completions
    assert out.group_tokens is not None and out.group_tokens.numel() == sum(r.num_prompts for r in rolled)
