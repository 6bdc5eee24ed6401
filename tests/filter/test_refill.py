"""Refill: the kept batch is filled to exactly the target size for any
pruning rate, deterministically, and stops cleanly when the stream runs dry."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from filter_fakes import fake_reward, fake_rollout
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.core import group_advantages
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.filter.dppo import DPPOFilter
from grpo_parts.filter.pods import MaxVarianceDownsample
from grpo_parts.filter.reference import KeepAll
from grpo_parts.filter.refill import Refiller, Round, concat_rollouts, fill_rollouts
from grpo_parts.filter.zero_variance import ZeroVarianceGroups
from grpo_parts.types import Rollout, ScoredBatch, VisionInputs

RATES = [0.5, 0.6, 0.75, 0.875, 0.9375]
G = 16


def run(filt, target: int, initial: int, start: int = 1, **kw):
    return fill_rollouts(
        filt,
        Refiller(target_size=target, initial_prompts=initial, **kw),
        itertools.count(start),
        lambda ps: fake_rollout(ps, G),
        fake_reward,
    )


@settings(max_examples=10)
@given(
    st.sampled_from(RATES),
    st.sampled_from(["global", "group"]),
    st.integers(1, 4),
    st.integers(0, 100),
    st.booleans(),
)
def test_fills_exactly_for_any_rate(rate: float, scope: str, b: int, start: int, cppo_sizing: bool) -> None:
    target = b * G
    initial = -(-b * 16 // round(16 * (1 - rate))) if cppo_sizing else b  # ceil(B / (1 - P)) or B
    out = run(TopKAbsAdvantage(pruning_rate=rate, scope=scope), target, initial, start)
    assert out.outcome.filled and out.outcome.num_kept == target
    r = out.rollout
    assert r is not None and r.num_completions == target == out.advantages.numel() == out.rewards.numel()
    assert r.num_prompts == len(out.prompts) == int(r.group_index.max()) + 1
    assert not bool((out.advantages == 0).any())  # zero-variance prompts (p % 3 == 0) never kept
    # rows carry their own prompt's data: re-scoring the kept rows gives the same rewards
    torch.testing.assert_close(fake_reward(out.prompts, r), out.rewards)
    # deterministic: the same stream gives the same batch
    again = run(TopKAbsAdvantage(pruning_rate=rate, scope=scope), target, initial, start)
    assert again.rollout is not None and torch.equal(again.rollout.completion_ids, r.completion_ids)


@pytest.mark.parametrize("rate", RATES)
def test_cppo_sizing_needs_one_round_when_no_zero_variance(rate: float) -> None:
    # prompts 1, 2, 4, 5, ... (p % 3 != 0): with ceil(B / (1 - P)) prompts one round suffices
    stream = (p for p in itertools.count(1) if p % 3)
    b, k = 4, round(G * (1 - rate))
    out = fill_rollouts(
        TopKAbsAdvantage(pruning_rate=rate, scope="group"),
        Refiller(target_size=b * G, initial_prompts=-(-b * G // k)),
        stream,
        lambda ps: fake_rollout(ps, G),
        fake_reward,
    )
    assert out.outcome.filled and out.outcome.rounds == 1


@pytest.mark.parametrize("filt", [ZeroVarianceGroups(), MaxVarianceDownsample(m=5), KeepAll()])
def test_other_filters_fill_exactly(filt) -> None:
    out = run(filt, 3 * G + 5, 3)
    assert out.outcome.filled and out.rollout is not None and out.rollout.num_completions == 3 * G + 5


def test_trim_keeps_largest_abs_advantage_of_last_round() -> None:
    out = run(ZeroVarianceGroups(), 20, 1, start=1)  # prompt 1: 16 kept; prompt 2: 4 of 16 kept
    assert out.outcome.rounds == 2
    last = out.outcome.selections[-1]
    _, _, _, adv = last.round.payload
    top4 = torch.sort(torch.argsort(-adv.abs(), stable=True)[:4]).values
    assert torch.equal(last.kept, top4)


def test_stream_exhausted_or_all_zero_variance_gives_short_or_empty_batch() -> None:
    out = run(TopKAbsAdvantage(pruning_rate=0.5), 10 * G, 2, max_prompts=4)
    assert not out.outcome.filled and out.outcome.prompts_used == 4
    zero = fill_rollouts(
        TopKAbsAdvantage(pruning_rate=0.5),
        Refiller(target_size=G, initial_prompts=2, max_rounds=3),
        iter([3, 6, 9, 12, 15, 18, 21]),
        lambda ps: fake_rollout(ps, G),
        fake_reward,
    )
    assert zero.is_empty and zero.outcome.num_kept == 0 and zero.rollout is None
    assert zero.outcome.rounds == 3  # asked for more, then gave up at max_rounds (no crash, no NaN)
    dry = fill_rollouts(
        KeepAll(), Refiller(target_size=G, initial_prompts=2), iter([]), fake_rollout, fake_reward
    )
    assert dry.is_empty and dry.outcome.rounds == 0


def test_refiller_is_framework_agnostic() -> None:
    """Any payload: here a dict of lists, as an adapter would hold."""
    rng = torch.Generator().manual_seed(0)

    def produce(n: int) -> Round[dict]:
        gi = torch.arange(n).repeat_interleave(4)
        r = torch.rand(4 * n, generator=rng, dtype=torch.float64)
        return Round({"rows": list(range(4 * n))}, ScoredBatch(r, group_advantages(r, gi), gi), n)

    out = Refiller(target_size=10, initial_prompts=2).fill(TopKAbsAdvantage(pruning_rate=0.6), produce)
    assert out.num_kept == 10 and sum(int(s.kept.numel()) for s in out.selections) == 10


def test_validation_and_concat() -> None:
    with pytest.raises(ValidationError, match="target_size"):
        Refiller(target_size=0, initial_prompts=1)
    with pytest.raises(ValidationError, match="initial_prompts"):
        Refiller(target_size=1, initial_prompts=0)
    with pytest.raises(GRPOPartsError, match="rollouts"):
        concat_rollouts([])
    a, b = fake_rollout([1], 2, max_t=3), fake_rollout([2], 3, max_t=6)
    c = concat_rollouts([a, b])
    assert c.num_prompts == 2 and c.group_index.tolist() == [0, 0, 1, 1, 1]
    assert torch.equal(c.completion_mask.sum(-1), torch.cat([a.completion_lengths(), b.completion_lengths()]))
    with pytest.raises(GRPOPartsError, match="sample: expected a Rollout of 2 prompts"):
        fill_rollouts(
            KeepAll(),
            Refiller(target_size=4, initial_prompts=2),
            iter([1, 2]),
            lambda ps: fake_rollout(ps[:1], 2),
            fake_reward,
        )


def test_refill_has_one_name() -> None:
    """``refill_rounds`` (extra rounds; 0 = none) is the one spelling: an earlier pair (``refill`` +
    a round count) is an unknown field like any other."""
    import pytest

    from grpo_parts.errors import GRPOPartsError
    from grpo_parts.train.config import load_config

    assert load_config(sets=["parts.refill_rounds=2"]).parts.refill_rounds == 2
    for old in ("parts.refill=true", "parts.max_refill_rounds=2"):
        with pytest.raises(GRPOPartsError, match=old.split("=")[0] + ": unknown field"):
            load_config(sets=[old])


def _with_images(prompts: list[int]) -> Rollout:
    """fake_rollout, each prompt carrying ``p % 3`` images whose pixels hold ``p`` (0 images: none)."""
    ro = fake_rollout(prompts, G)
    per = tuple({"pixel_values": torch.full((p % 3, 2), float(p))} if p % 3 else {} for p in prompts)
    return replace(ro, vision=VisionInputs(per))


@pytest.mark.parametrize(
    "filt",
    [TopKAbsAdvantage(pruning_rate=0.5), ZeroVarianceGroups(), MaxVarianceDownsample(m=5), KeepAll(),
     DPPOFilter(pruning_rate=0.5)],
)  # fmt: skip
def test_kept_rows_keep_their_own_prompts_images(filt) -> None:
    prompts = itertools.count(1)
    # dppo's weights fix its batch: one round, no refill
    rounds = {"max_rounds": 1} if filt.name == "dppo" else {}
    refiller = Refiller(target_size=3 * G, initial_prompts=2, **rounds)
    out = fill_rollouts(filt, refiller, prompts, _with_images, fake_reward)
    ro = out.rollout
    assert ro is not None and ro.vision is not None and len(ro.vision.per_prompt) == ro.num_prompts
    seen = set()
    for row in range(ro.num_completions):
        images = ro.vision.gather([int(ro.group_index[row])])
        prompt = ro.prompt_ids[row][ro.prompt_mask[row].bool()]
        # the row's prompt tells which p it came from; its images must be p's (p % 3 of them)
        p = next(p for p in range(1, 200) if torch.equal(_prompt_of(p), prompt))
        seen.add(p)
        if p % 3 == 0:
            assert images == {}
        else:
            assert images["pixel_values"].shape[0] == p % 3 and bool((images["pixel_values"] == p).all())
    assert len(seen) > 1  # rows of several prompts, with different numbers of images
    batch = LogprobBatch.from_rollout(ro)  # the training forward gets the same images
    assert batch.vision is ro.vision


def _prompt_of(p: int) -> torch.Tensor:
    one = fake_rollout([p], 1)
    return one.prompt_ids[0][one.prompt_mask[0].bool()]
