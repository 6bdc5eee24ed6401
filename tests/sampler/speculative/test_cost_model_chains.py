"""Measured per-depth chain acceptance: chains priced by what each draft position really accepts, per
batch-size bucket, instead of one geometric per-token rate (which over-credited long chains)."""

from __future__ import annotations

import pytest
import torch

from grpo_parts.sampler.speculative.acceptance import (
    AcceptanceEstimate,
    chain_expected_tokens,
    expected_tokens,
)
from grpo_parts.sampler.speculative.cost_model import CostModel


def gpu_like() -> CostModel:
    """Verification free up to 64 tokens per step (``A * T``), then linear."""
    sizes, tokens = [1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 5, 7, 9, 13]
    cost = CostModel(sizes, tokens, {a: [1e-3 * max(1.0, a * t / 64) for t in tokens] for a in sizes})
    for a in sizes:
        cost.draft_fixed[a], cost.draft_per_token[a] = 1e-5, 2e-5
    return cost


def sampler_with(cost: CostModel, max_draft: int):  # type: ignore[no-untyped-def]
    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
    from grpo_parts.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1)
    sampler = SpeculativeSampler(model, NGramDraft(), SpeculativeConfig(max_draft_tokens=max_draft))
    sampler.cost = cost
    sampler.acceptance = AcceptanceEstimate(prior=0.6, decay=1.0)
    return sampler


def test_chain_expected_tokens_matches_geometric() -> None:
    for a in (0.0, 0.3, 0.9):
        for k in (0, 1, 4):
            assert chain_expected_tokens([a] * 6, k) == pytest.approx(expected_tokens(a, k))
    assert chain_expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_depth_rates_are_measured_per_depth() -> None:
    est = AcceptanceEstimate(prior=0.6, decay=1.0)
    assert len(est.depth_rates(1, 6)) == 1  # nothing measured: only k <= 1 is priced
    for _ in range(100):  # every row accepts draft 1, none accepts draft 2
        est.update(torch.ones(4, dtype=torch.long), 6, bucket=1)
    r = est.depth_rates(1, 6)
    assert len(r) == 3  # depths 1-2 reached, depth 3 is the one-step probe
    assert r[0] > 0.95 and r[1] < 0.05 and r[2] < 0.05
    assert est.rate == pytest.approx(0.5, abs=0.02)  # the geometric rate says "half of each"


def test_one_accepted_then_none_drafts_one_token() -> None:
    """Depth 1 always accepted, depth 2 never: k = 1 is the best chain. The geometric rate (~0.5)
    credits a 6-chain with ~2 tokens and drafted 6 (fails on the geometric cost model)."""
    sampler = sampler_with(gpu_like(), 6)
    for _ in range(100):
        sampler.acceptance.update(torch.ones(4, dtype=torch.long), 6)
    assert sampler.choose_k(1, 100, 0) == 1


def test_never_measured_depths_are_not_over_credited() -> None:
    """Chains of 6 measured nearly always fully accepted (the n-gram draft's long copies): with a
    ceiling of 12 the next chain is 7 (one probe past the measured depths), not 12 on the strength of
    one global rate (fails on the geometric cost model, which drafted 12); a 7th position measured to
    reject keeps chains at 6; one measured to accept opens the 8th."""
    sampler = sampler_with(gpu_like(), 12)
    six = torch.tensor([6] * 9 + [0])
    for _ in range(100):
        sampler.acceptance.update(six, 6)
    assert sampler.choose_k(1, 100, 0) == 7
    for _ in range(100):  # rows reaching the 7th position reject it
        sampler.acceptance.update(six, 7)
    rates = sampler.chain_rates(1, 12)
    assert rates[6] < 0.05 and len(rates) == 8
    assert sampler.choose_k(1, 100, 0) == 6
    good = sampler_with(gpu_like(), 12)
    for _ in range(100):
        good.acceptance.update(torch.tensor([7] * 9 + [0]), 7)
    assert good.choose_k(1, 100, 0) == 8


def test_buckets_keep_their_own_depth_rates() -> None:
    """The wide phase (64 rows) and the tail (1 row) accept differently: each bucket is priced by its
    own measurements (shrunk towards the pooled ones), so the tail drafts long while the wide phase
    does not."""
    sampler = sampler_with(gpu_like(), 6)
    sampler.cost.verify = {a: [1e-3] * 7 for a in sampler.cost.batch_sizes}  # verification free everywhere
    for _ in range(100):
        sampler.acceptance.update(torch.zeros(64, dtype=torch.long), 6, bucket=64)
        sampler.acceptance.update(torch.tensor([6]), 6, bucket=1)
    wide, tail = sampler.chain_rates(64, 6), sampler.chain_rates(1, 6)
    assert wide[0] < 0.1 and min(tail) > 0.9
    assert sampler.choose_k(1, 100, 0) == 6
    assert sampler.choose_k(64, 100, 0) == 0


def test_speculative_overhead_is_priced_per_verified_position() -> None:
    """The residual a speculative step costs beyond the calibrated forward and the draft grows with
    the positions verified; priced per position, a 3-token verification is not charged the residual
    measured on 7-token ones (a constant per step made long chains look relatively cheap)."""
    cost = gpu_like()
    pred7, pred3 = cost.step_time(64, 6), cost.step_time(64, 2)
    for _ in range(50):
        cost.observe_step(64, 6, pred7 + 70e-3, cost.t_draft(64, 6), predicted=pred7 + 70e-3)
    assert cost.overhead_at(64, True, 7) == pytest.approx(70e-3, rel=1e-3)
    assert cost.step_time(64, 2) == pytest.approx(pred3 + 30e-3, rel=1e-3)
    assert cost.overhead_at(64, False) == 0.0


def test_eagle_chains_longer_than_the_rows_text() -> None:
    """A chain of 12 on rows whose prompt + completion is shorter than the 13 policy features the
    EAGLE head catches up on (short prompts): it used to crash (``torch.cat`` size mismatch in the
    head); greedy output equals the reference sampler's."""
    from grpo_parts.draft.eagle import EagleDraft
    from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
    from grpo_parts.sampler.reference import ReferenceSampler
    from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
    from grpo_parts.tiny import tiny_causal_lm

    policy = tiny_causal_lm("qwen2", vocab_size=8, hidden_size=32, num_layers=2, seed=0)
    prompts = PromptBatch.from_lists([[1, 2], [4], [6, 7, 1]], pad_token_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=20, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    cfg = SpeculativeConfig(draft_tokens=12, max_draft_tokens=12, train_draft=False)
    out = SpeculativeSampler(policy, EagleDraft(policy), cfg).generate(prompts, params)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert out.stats["verify_steps"] > 0
