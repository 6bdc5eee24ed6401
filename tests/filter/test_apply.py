"""Applying a FilterResult: same loss/gradients as no filter when everything is kept; the pruned
gradient is the full batch's per-completion gradients restricted to the kept rows, rescaled by
``D_full / D_kept`` (the documented normalisation); an empty kept set is skipped without NaN."""

from __future__ import annotations

import pytest
import torch
from filter_fakes import fake_reward, fake_rollout
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.core import LossConfig, aggregate, group_advantages, grpo_loss
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.apply import apply_filter, loss_denominators, select_rows
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.filter.reference import KeepAll
from grpo_parts.tiny import tiny_causal_lm
from grpo_parts.types import FilterResult, ScoredBatch

AGG = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOL = {"rtol": 1e-10, "atol": 1e-12}


def setup(n_prompts: int, g: int, seed: int):
    rollout = fake_rollout(list(range(1, n_prompts + 1)), g)
    rewards = fake_reward(list(range(1, n_prompts + 1)), rollout)
    adv = group_advantages(rewards, rollout.group_index)
    gen = torch.Generator().manual_seed(seed)
    shape = rollout.completion_ids.shape
    old = -torch.rand(shape, generator=gen, dtype=torch.float64)
    ref = -torch.rand(shape, generator=gen, dtype=torch.float64)
    logps = (old + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    return rollout, rewards, adv, old, ref, logps


configs = st.builds(
    LossConfig,
    agg=st.sampled_from(AGG),
    kl_coef=st.sampled_from([0.0, 0.05]),
    eps_high=st.sampled_from([0.2, 0.28]),
)


@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 999), configs)
def test_keep_all_equals_no_filter(n_prompts: int, g: int, seed: int, cfg: LossConfig) -> None:
    rollout, rewards, adv, old, ref, logps = setup(n_prompts, g, seed)
    full = grpo_loss(logps, old, adv, rollout.completion_mask, cfg, ref)
    (g_full,) = torch.autograd.grad(full.loss, logps)
    kb = apply_filter(
        KeepAll().select(ScoredBatch(rewards, adv, rollout.group_index)), rollout, adv, old, ref
    )
    assert not kb.is_empty
    out = grpo_loss(
        logps[kb.kept],
        kb.old_logps,
        kb.advantages,
        kb.rollout.completion_mask,
        cfg,
        kb.ref_logps,
        num_tokens=kb.num_tokens,
        num_seqs=kb.num_seqs,
    )
    (g_kept,) = torch.autograd.grad(out.loss, logps)
    torch.testing.assert_close(out.loss, full.loss, **TOL)
    torch.testing.assert_close(g_kept, g_full, **TOL)


@given(
    st.integers(1, 4),
    st.integers(2, 6),
    st.integers(0, 999),
    configs,
    st.sampled_from([0.25, 0.5, 0.75]),
    st.sampled_from(["global", "group"]),
)
def test_pruned_gradient_is_restricted_full_gradient(n_prompts, g, seed, cfg, rate, scope) -> None:
    rollout, rewards, adv, old, ref, logps = setup(n_prompts, g, seed)
    res = TopKAbsAdvantage(pruning_rate=rate, scope=scope).select(
        ScoredBatch(rewards, adv, rollout.group_index)
    )
    kb = apply_filter(res, rollout, adv, old, ref)
    if kb.is_empty:
        return
    full = grpo_loss(logps, old, adv, rollout.completion_mask, cfg, ref)
    (g_full,) = torch.autograd.grad(full.loss, logps)
    out = grpo_loss(
        logps[kb.kept], kb.old_logps, kb.advantages, kb.rollout.completion_mask, cfg, kb.ref_logps
    )
    (g_pruned,) = torch.autograd.grad(out.loss, logps)
    tok_full, seq_full = loss_denominators(rollout.completion_mask)
    scale = tok_full / kb.num_tokens if cfg.agg == "token-mean" else seq_full / kb.num_seqs
    pruned = torch.ones(rollout.num_completions, dtype=torch.bool)
    pruned[kb.kept] = False
    torch.testing.assert_close(g_pruned[kb.kept], g_full[kb.kept] * scale, **TOL)
    assert bool((g_pruned[pruned] == 0).all())
    # micro-batches normalised by the kept set's denominators sum to the pruned loss
    half = kb.size // 2
    parts = [slice(0, half), slice(half, kb.size)]
    total = sum(
        grpo_loss(
            logps[kb.kept][s],
            kb.old_logps[s],
            kb.advantages[s],
            kb.rollout.completion_mask[s],
            cfg,
            kb.ref_logps[s],
            num_tokens=kb.num_tokens,
            num_seqs=kb.num_seqs,
        ).loss
        for s in parts
        if s.stop > s.start
    )
    torch.testing.assert_close(total, out.loss, **TOL)


@settings(max_examples=4)
@given(st.integers(0, 999), st.sampled_from(AGG), st.sampled_from([0.5, 0.75]))
def test_model_gradient_is_sum_of_kept_per_completion_gradients(seed: int, agg: str, rate: float) -> None:
    """Through a real model (tiny qwen2, float64, reference attention): the parameter gradient of the
    pruned loss equals sum over kept rows of per-completion gradients / D_kept."""
    model = tiny_causal_lm(
        "qwen2", vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, dtype=torch.float64, seed=seed
    )
    backend = RepeatedPrefixAttention()
    rollout, rewards, adv, _, _, _ = setup(3, 3, seed)
    with torch.no_grad():  # near-policy old log-probs, so the ratio is not clipped everywhere
        old = backend.completion_logprobs(model, LogprobBatch.from_rollout(rollout)).logprobs
        old = old + 0.05 * torch.randn(
            old.shape, generator=torch.Generator().manual_seed(seed), dtype=old.dtype
        )
    cfg = LossConfig(agg=agg)
    res = TopKAbsAdvantage(pruning_rate=rate).select(ScoredBatch(rewards, adv, rollout.group_index))
    kb = apply_filter(res, rollout, adv, old)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(rows: torch.Tensor, **denoms) -> list[torch.Tensor]:
        sub = rollout.select(rows)
        logps = backend.completion_logprobs(model, LogprobBatch.from_rollout(sub)).logprobs
        loss = grpo_loss(logps, old[rows], adv[rows], sub.completion_mask, cfg, **denoms).loss
        return list(torch.autograd.grad(loss, params, allow_unused=True))

    pruned = grads(kb.kept)
    d_kept = kb.num_tokens if agg == "token-mean" else kb.num_seqs
    # per-completion gradient: the row's unnormalised contribution (denominator 1)
    per_row = [grads(kb.kept[i : i + 1], num_tokens=1.0, num_seqs=1.0) for i in range(kb.size)]
    nonzero = 0
    for j, gp in enumerate(pruned):
        if gp is None:
            continue
        nonzero += int(bool((gp != 0).any()))
        expect = sum(pr[j] for pr in per_row if pr[j] is not None) / d_kept
        # transformers' RMSNorm computes in float32 even in a float64 model, so sums taken in a
        # different order (one batch vs row by row) can flip a float32 rounding: 1e-6 relative.
        torch.testing.assert_close(gp, expect, rtol=1e-6, atol=1e-6 * float(expect.abs().max()))
    assert nonzero > 0


def test_all_zero_advantages_loop_skips_without_nan() -> None:
    model = tiny_causal_lm("qwen2", vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend = RepeatedPrefixAttention()
    rollout = fake_rollout([3, 6, 9], 4)  # prompts divisible by 3: every reward equal
    rewards = fake_reward([3, 6, 9], rollout)
    adv = group_advantages(rewards, rollout.group_index)
    assert bool((adv == 0).all())
    steps = 0
    for filt in (TopKAbsAdvantage(pruning_rate=0.5), TopKAbsAdvantage(k=2, scope="group")):
        res = filt.select(ScoredBatch(rewards, adv, rollout.group_index), target_size=12)
        kb = apply_filter(res, rollout, adv, rollout.logprobs.float())
        assert res.is_empty and kb.is_empty and kb.size == 0 and kb.advantages.shape == (0,)
        if kb.is_empty:  # the loop's skip
            continue
        logps = backend.completion_logprobs(model, LogprobBatch.from_rollout(kb.rollout)).logprobs
        grpo_loss(logps, kb.old_logps, kb.advantages, kb.rollout.completion_mask).loss.backward()
        opt.step()
        steps += 1
    assert steps == 0
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q) and bool(torch.isfinite(q).all())
    # without the skip: a clear error (never a NaN loss); the aggregation of zero rows is 0
    z = torch.zeros(0, 5)
    with pytest.raises(GRPOPartsError, match="logps: expected a non-empty tensor"):
        grpo_loss(z, z, torch.zeros(0), z.long())
    for agg in AGG:
        assert float(aggregate(z, z.long(), agg)) == 0.0


def test_apply_filter_validates_and_select_rows() -> None:
    rollout = fake_rollout([1, 2], 2)
    adv = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(GRPOPartsError, match="advantages"):
        apply_filter(FilterResult(torch.tensor([0])), rollout, torch.zeros(3))
    with pytest.raises(GRPOPartsError, match="old_logps"):
        apply_filter(FilterResult(torch.tensor([0])), rollout, adv, old_logps=torch.zeros(4, 2))
    with pytest.raises(GRPOPartsError, match=r"FilterResult.kept: expected row indices in \[0, 4\)"):
        apply_filter(FilterResult(torch.tensor([1, 7])), rollout, adv)
    d = {
        "ids": torch.arange(8).view(4, 2),
        "names": ["a", "b", "c", "d"],
        "n": 3,
        "scalar": torch.tensor(1.0),
    }
    out = select_rows(d, torch.tensor([1, 3]), 4)
    assert out["ids"].tolist() == [[2, 3], [6, 7]] and out["names"] == ["b", "d"] and out["n"] == 3
