"""The dppo filter: its draws follow the probabilities it reports (chi-square on the exact joint
distribution, binomial tests on the marginals), the probability rule, weights, reproducibility and
checkpointing, refusals, ``apply_filter`` and ``grpo_loss`` with weights. Unbiasedness itself:
tests/core/test_unbiased.py."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import pytest
import torch
from dppo_outcomes import bernoulli_outcomes, systematic_outcomes
from filter_fakes import scored_batches
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from grpo_parts.core import LossConfig, grpo_loss
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter import CompletionFilter, get_filter_class
from grpo_parts.filter.apply import apply_filter, loss_denominators
from grpo_parts.filter.dppo import DPPOFilter
from grpo_parts.types import FilterResult, Rollout, ScoredBatch, Stateful

DOC = Path(__file__).resolve().parents[2] / "docs" / "filter.md"


def batch_of(adv: list[float]) -> ScoredBatch:
    a = torch.tensor(adv, dtype=torch.float64)
    return ScoredBatch(a.clone(), a, torch.zeros(len(adv), dtype=torch.long))


def draw_counts(filt: DPPOFilter, batch: ScoredBatch, draws: int) -> dict[frozenset[int], int]:
    counts: dict[frozenset[int], int] = {}
    p = filt.inclusion_probs(batch)
    for _ in range(draws):
        res = filt.select(batch)
        assert res.weights is not None
        torch.testing.assert_close(res.weights, 1.0 / p[res.kept], rtol=0, atol=0)
        key = frozenset(res.kept.tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("sampling", ["bernoulli", "systematic"])
def test_joint_keep_frequencies_match_the_design(sampling: str) -> None:
    """Chi-square of 2000 draws against every outcome's exact probability."""
    batch = batch_of([2.0, -1.0, 0.5, -0.3, 0.0])
    filt = DPPOFilter(k=2, min_keep_prob=0.2, sampling=sampling, seed=3)
    p = filt.inclusion_probs(batch)
    assert float(p[4]) == 0.0 and float(p.sum()) == pytest.approx(2.0, abs=1e-12)
    design = (systematic_outcomes if sampling == "systematic" else bernoulli_outcomes)(p.tolist())
    draws = 2000
    counts = draw_counts(filt, batch, draws)
    assert set(counts) <= set(design)  # nothing the design cannot produce
    keys = sorted(design, key=sorted)
    obs = [counts.get(k, 0) for k in keys]
    exp = [design[k] * draws for k in keys]
    assert min(exp) > 5
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    if sampling == "systematic":
        assert {len(k) for k in counts} == {2}


@pytest.mark.parametrize("sampling", ["bernoulli", "systematic"])
def test_marginal_keep_frequencies_match_the_probabilities(sampling: str) -> None:
    gen = torch.Generator().manual_seed(0)
    adv = (
        torch.randn(24, generator=gen, dtype=torch.float64) * (torch.rand(24, generator=gen) > 0.2)
    ).tolist()
    batch = batch_of(adv)
    filt = DPPOFilter(pruning_rate=0.7, min_keep_prob=0.05, sampling=sampling, seed=11)
    p = filt.inclusion_probs(batch)
    draws = 1000
    hits = torch.zeros(24)
    for _ in range(draws):
        hits[filt.select(batch).kept] += 1
    for i in range(24):
        if float(p[i]) in (0.0, 1.0):
            assert int(hits[i]) == round(float(p[i]) * draws)
        else:
            assert stats.binomtest(int(hits[i]), draws, float(p[i])).pvalue > 1e-3 / 24


@settings(max_examples=30, derandomize=True, deadline=None)
@given(
    scored_batches(max_groups=5, max_g=6),
    st.sampled_from([0.0, 0.3, 0.75, 0.9]),
    st.sampled_from([0.01, 0.1, 0.4]),
    st.booleans(),
)
def test_probability_rule(batch: ScoredBatch, rate: float, floor: float, drop_zero: bool) -> None:
    filt = DPPOFilter(pruning_rate=rate, min_keep_prob=floor, drop_zero_advantage=drop_zero)
    p = filt.inclusion_probs(batch)
    a = batch.advantages.abs().double()
    eligible = a > 0 if drop_zero else torch.ones_like(a, dtype=torch.bool)
    assert bool((p[~eligible] == 0).all())
    pe, ae = p[eligible], a[eligible]
    n_e = int(eligible.sum())
    if n_e == 0:
        return
    assert bool(((pe >= floor - 1e-12) & (pe <= 1.0)).all())
    want = min(n_e, max(filt.target_kept(batch.size), math.ceil(floor * n_e - 1e-9)))  # the floor wins
    assert float(pe.sum()) == pytest.approx(want, abs=1e-9)
    # larger |A| never gets a smaller probability; strictly between the bounds, p is proportional to |A|
    order = torch.argsort(ae)
    assert bool((pe[order][1:] >= pe[order][:-1] - 1e-12).all())
    mid = (pe > floor + 1e-9) & (pe < 1.0 - 1e-9) & (ae > 0)
    if int(mid.sum()) >= 2:
        ratio = pe[mid] / ae[mid]
        torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio), rtol=1e-9, atol=0)


def test_reproducible_and_checkpointable() -> None:
    batch = batch_of([1.0, -0.5, 0.25, 2.0, -1.5, 0.1, 0.0, 0.7])
    a, b = DPPOFilter(k=3, seed=5), DPPOFilter(k=3, seed=5)
    assert [a.select(batch).kept.tolist() for _ in range(5)] == [
        b.select(batch).kept.tolist() for _ in range(5)
    ]
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    ahead = [a.select(batch).kept.tolist() for _ in range(5)]
    resumed = DPPOFilter(k=3, seed=999)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))
    assert [resumed.select(batch).kept.tolist() for _ in range(5)] == ahead
    assert isinstance(a, Stateful) and isinstance(a, CompletionFilter)
    assert get_filter_class("dppo") is DPPOFilter


def test_validation_and_empty() -> None:
    with pytest.raises(ValueError, match="k / pruning_rate: expected at most one"):
        DPPOFilter(k=2, pruning_rate=0.5)
    with pytest.raises(ValueError, match="min_keep_prob"):
        DPPOFilter(min_keep_prob=0.0)
    assert DPPOFilter().target_kept(10) == 5  # neither given: pruning_rate 0.5
    filt = DPPOFilter(k=2)
    res = filt.select(batch_of([0.0, 0.0, 0.0]))  # all-zero advantages: nothing to learn
    assert res.is_empty and res.weights is not None and res.weights.numel() == 0
    empty = ScoredBatch(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert filt.select(empty).is_empty and filt.not_supported_reasons(empty) == []
    inf = batch_of([1.0, float("inf")])
    assert "finite" in filt.not_supported_reasons(inf)[0]


def test_filter_result_weights_are_checked() -> None:
    kept = torch.tensor([0, 2])
    with pytest.raises(GRPOPartsError, match=r"FilterResult.weights: expected shape \[2\]"):
        FilterResult(kept, 0, {}, torch.ones(3))
    with pytest.raises(GRPOPartsError, match="FilterResult.weights: expected finite values > 0"):
        FilterResult(kept, 0, {}, torch.tensor([1.0, 0.0]))
    assert FilterResult(kept).weights is None


def _rollout(n: int, t: int) -> Rollout:
    lengths = torch.arange(n) % t + 1
    mask = (torch.arange(t) < lengths[:, None]).long()
    ones = torch.ones(n, 2, dtype=torch.long)
    return Rollout(ones, ones, mask.clone(), mask, torch.zeros(n, t), torch.arange(n) // 2, (n + 1) // 2)


def test_apply_filter_carries_weights_and_the_full_denominators() -> None:
    rollout = _rollout(6, 3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0])
    res = FilterResult(torch.tensor([0, 3]), 0, {}, torch.tensor([1.5, 4.0], dtype=torch.float64))
    kb = apply_filter(res, rollout, adv)
    assert (kb.num_tokens, kb.num_seqs) == loss_denominators(rollout.completion_mask) == (12.0, 6.0)
    assert kb.weights is not None and kb.weights.tolist() == [1.5, 4.0]
    plain = apply_filter(FilterResult(torch.tensor([0, 3])), rollout, adv)
    assert (plain.num_tokens, plain.num_seqs, plain.weights) == (2.0, 2.0, None)  # kept set's own


def test_grpo_loss_weights() -> None:
    """Without seq_weights nothing changes; weights of 1 with the same denominators give the same
    loss bit for bit; weights need the full batch's denominators (one-line refusals)."""
    gen = torch.Generator().manual_seed(1)
    rollout = _rollout(4, 3)
    mask = rollout.completion_mask
    old = -torch.rand(4, 3, generator=gen, dtype=torch.float64)
    logps = old + 0.1 * torch.randn(4, 3, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    tokens, seqs = loss_denominators(mask)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        cfg = LossConfig(agg=agg, norm_constant=3.0 if agg == "seq-mean-token-sum-norm" else None)
        base = grpo_loss(logps, old, adv, mask, cfg).loss
        ones = torch.ones(4, dtype=torch.float64)
        same = grpo_loss(logps, old, adv, mask, cfg, num_tokens=tokens, num_seqs=seqs, seq_weights=ones).loss
        assert torch.equal(base, same)
        twice = grpo_loss(
            logps, old, adv, mask, cfg, num_tokens=tokens, num_seqs=seqs, seq_weights=2 * ones
        ).loss
        torch.testing.assert_close(twice, 2 * base)
    w = torch.ones(4, dtype=torch.float64)
    with pytest.raises(GRPOPartsError, match=r"^seq_weights: agg='token-mean' needs num_tokens="):
        grpo_loss(logps, old, adv, mask, LossConfig(), seq_weights=w)
    with pytest.raises(GRPOPartsError, match=r"^seq_weights: agg='seq-mean-token-mean' needs num_seqs="):
        grpo_loss(logps, old, adv, mask, LossConfig(agg="seq-mean-token-mean"), seq_weights=w)
    cfg = LossConfig(agg="seq-mean-token-mean", kl_coef=0.1, kl_agg="token-mean")
    with pytest.raises(GRPOPartsError, match=r"^seq_weights: kl_agg='token-mean' needs num_tokens="):
        grpo_loss(logps, old, adv, mask, cfg, old, num_seqs=4.0, seq_weights=w)
    with pytest.raises(GRPOPartsError, match=r"^seq_weights: expected finite values >= 0"):
        grpo_loss(logps, old, adv, mask, num_tokens=tokens, seq_weights=-w)


def test_docs_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    (code,) = [b for b in blocks if "DPPOFilter" in b]
    exec(compile(code, str(DOC), "exec"), {})
