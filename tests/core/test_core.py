"""GRPO core maths: hand-computed cases, hypothesis properties, and gradients against a naive loop."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_parts.core import (
    AdvantageConfig,
    LossConfig,
    aggregate,
    group_advantages,
    group_stats,
    grpo_loss,
    kl_estimate,
)

F64 = torch.float64
EPS = 1e-6

# ----------------------------------------------------------------------------- hand-computed cases


def _rewards():
    # group 0: [1, 2, 3] (non-contiguous rows 0, 3, 5); group 1: [5, 5] zero variance; group 2: singleton
    r = torch.tensor([1.0, 5.0, 4.0, 2.0, 5.0, 3.0], dtype=F64)
    g = torch.tensor([0, 1, 2, 0, 1, 0])
    return r, g


def test_group_advantages_hand_group_unbiased():
    r, g = _rewards()
    adv = group_advantages(r, g)  # mean 2, unbiased std 1
    want = torch.tensor([-1 / (1 + EPS), 0.0, 0.0, 0.0, 0.0, 1 / (1 + EPS)], dtype=F64)
    torch.testing.assert_close(adv, want, atol=1e-15, rtol=0)


def test_group_advantages_hand_group_biased():
    r, g = _rewards()
    adv = group_advantages(r, g, AdvantageConfig(unbiased_std=False, eps=0.0))  # biased std sqrt(2/3)
    s = math.sqrt(2 / 3)
    want = torch.tensor([-1 / s, 0.0, 0.0, 0.0, 0.0, 1 / s], dtype=F64)
    torch.testing.assert_close(adv, want, atol=1e-15, rtol=0)


def test_group_advantages_hand_no_std():
    r, g = _rewards()
    adv = group_advantages(r, g, AdvantageConfig(norm="none"))
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0, 0, 0, 0, 1], dtype=F64), atol=0, rtol=0)


def test_group_advantages_hand_batch_norm():
    r, g = _rewards()
    bstd = statistics.stdev(r.tolist())  # std of the whole batch, mean still per group
    adv = group_advantages(r, g, AdvantageConfig(norm="batch"))
    want = torch.tensor([-1.0, 0, 0, 0, 0, 1], dtype=F64) / (bstd + EPS)
    torch.testing.assert_close(adv, want, atol=1e-15, rtol=0)


def test_group_stats_hand():
    r, g = _rewards()
    count, mean, std, zero = group_stats(r, g, num_groups=4)
    assert count.tolist() == [3, 2, 1, 0]
    assert mean.tolist() == [2.0, 5.0, 4.0, 0.0]
    assert std[0].item() == pytest.approx(1.0)
    assert zero.tolist() == [False, True, True, True]


def _loss_inputs():
    # ratios 1.5, 0.5, 1.0 against advantages +1 / -1
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]], dtype=F64))
    old = torch.zeros_like(logps)
    mask = torch.ones_like(logps)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    return logps, old, mask, adv


def test_grpo_loss_hand_per_token_clip():
    logps, old, mask, adv = _loss_inputs()
    out = grpo_loss(logps, old, adv, mask, LossConfig(eps_low=0.2, eps_high=0.2))
    # A=+1: -min(r, clip(r)) -> ratio 1.5 clipped to 1.2; 0.5 not clipped (min picks 0.5)
    # A=-1: -min(-r, -clip(r)) = max(r, clip(r)) -> 1.5 unclipped; 0.5 -> 0.8
    want = torch.tensor([[-1.2, -0.5, -1.0], [1.5, 0.8, 1.0]], dtype=F64)
    torch.testing.assert_close(out.per_token_loss, want, atol=1e-15, rtol=0)
    torch.testing.assert_close(out.loss, want.mean(), atol=1e-15, rtol=0)
    assert out.clip_fraction == pytest.approx(2 / 6)
    assert out.ratio_mean == pytest.approx(1.0)


def test_grpo_loss_hand_asymmetric_and_dual_clip():
    logps, old, mask, adv = _loss_inputs()
    out = grpo_loss(logps, old, adv, mask, LossConfig(eps_low=0.1, eps_high=0.3, dual_clip=1.4))
    # A=+1: 1.5 -> 1.3; A=-1: 1.5 capped by dual clip at 1.4, 0.5 -> 0.9
    want = torch.tensor([[-1.3, -0.5, -1.0], [1.4, 0.9, 1.0]], dtype=F64)
    torch.testing.assert_close(out.per_token_loss, want, atol=1e-15, rtol=0)


def test_grpo_loss_hand_kl_and_aggregation():
    logps, old, mask, adv = _loss_inputs()
    ref = logps - math.log(2.0)  # log pi - log pi_ref = log 2 everywhere
    mask[1, 1:] = 0
    cfg = LossConfig(kl_coef=0.5, kl_estimator="k1", agg="seq-mean-token-mean")
    out = grpo_loss(logps, old, adv, mask, cfg, ref)
    pg = torch.tensor([[-1.2, -0.5, -1.0], [1.5, 0.8, 1.0]], dtype=F64)
    per_tok = pg + 0.5 * math.log(2.0)
    torch.testing.assert_close(out.per_token_loss, per_tok * mask, atol=1e-15, rtol=0)  # 0 where masked
    want = (per_tok[0].mean() + per_tok[1, 0]) / 2
    torch.testing.assert_close(out.loss, want, atol=1e-15, rtol=0)
    assert out.kl == pytest.approx(math.log(2.0))


@pytest.mark.parametrize(
    "estimator,want",
    [("k1", math.log(2)), ("k2", 0.5 * math.log(2) ** 2), ("k3", 0.5 + math.log(2) - 1.0)],
)
def test_kl_estimate_hand(estimator, want):
    logp = torch.tensor([math.log(0.5)], dtype=F64)
    ref = torch.tensor([math.log(0.25)], dtype=F64)  # d = log(ref/pi) = -log 2
    assert kl_estimate(logp, ref, estimator).item() == pytest.approx(want, abs=1e-15)


def test_kl_k3_clamps_like_verl():
    logp = torch.tensor([0.0, 0.0], dtype=F64)
    ref = torch.tensor([30.0, -30.0], dtype=F64)
    out = kl_estimate(logp, ref, "k3")
    assert out.tolist() == [10.0, 10.0]  # exp(20) - 21 and exp(-20) + 19 both clamp to 10


LM = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row fully masked: not a sequence


@pytest.mark.parametrize(
    "mode,kw,want",
    [
        ("token-mean", {}, (1 + 2 + 4) / 3),
        ("token-mean", {"num_tokens": 7.0}, (1 + 2 + 4) / 7),
        ("seq-mean-token-mean", {}, (1.5 + 4) / 2),
        ("seq-mean-token-mean", {"num_seqs": 4.0}, (1.5 + 4) / 4),
        ("seq-mean-token-sum-norm", {}, (3 + 4) / 2 / 3),
        ("seq-mean-token-sum-norm", {"norm_constant": 2.0}, (3 + 4) / 2 / 2),
        ("seq-mean-token-sum-norm", {"norm_constant": 2.0, "num_seqs": 5.0}, (3 + 4) / 5 / 2),
    ],
)
def test_aggregate_hand(mode, kw, want):
    assert aggregate(LM, MASK, mode, **kw).item() == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_all_masked_is_zero_not_nan(mode):
    assert aggregate(LM, torch.zeros_like(MASK), mode).item() == 0.0


# ----------------------------------------------------------------------------- strategies


@st.composite
def grouped_rewards(draw, max_groups=5, max_size=6):
    """Rewards on a quarter grid (exact arithmetic, frequent ties), unequal group sizes, shuffled rows."""
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    n = sum(sizes)
    vals = draw(st.lists(st.integers(-12, 12), min_size=n, max_size=n))
    perm = draw(st.permutations(list(range(n))))
    group = torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)])[list(perm)]
    rewards = torch.tensor(vals, dtype=F64)[list(perm)] / 4
    return rewards, group, len(sizes)


def _naive_advantages(r: list[float], g: list[int], cfg: AdvantageConfig) -> list[float]:
    out = []
    sd = statistics.stdev if cfg.unbiased_std else statistics.pstdev
    for i, gi in enumerate(g):
        members = [r[j] for j in range(len(r)) if g[j] == gi]
        if len(members) < 2 or len(set(members)) == 1:
            out.append(0.0)
            continue
        a = r[i] - statistics.fmean(members)
        if cfg.norm == "group":
            a /= sd(members) + cfg.eps
        elif cfg.norm == "batch":
            a /= sd(r) + cfg.eps
        out.append(a)
    return out


ADV_CONFIGS = st.builds(
    AdvantageConfig,
    norm=st.sampled_from(["group", "batch", "none"]),
    unbiased_std=st.booleans(),
    eps=st.sampled_from([0.0, 1e-6, 1e-4]),
)


@given(grouped_rewards(), ADV_CONFIGS)
def test_advantages_match_naive_loop(data, cfg):
    r, g, _ = data
    adv = group_advantages(r, g, cfg)
    want = torch.tensor(_naive_advantages(r.tolist(), g.tolist(), cfg), dtype=F64)
    torch.testing.assert_close(adv, want, atol=1e-12, rtol=1e-12)


@given(grouped_rewards(), ADV_CONFIGS)
def test_advantages_sum_to_zero_per_group_and_never_nan(data, cfg):
    r, g, k = data
    adv = group_advantages(r, g, cfg)
    assert not bool(adv.isnan().any())
    sums = torch.zeros(k, dtype=F64).index_add_(0, g, adv)
    assert float(sums.abs().max()) < 1e-12


@given(
    grouped_rewards(),
    st.lists(st.integers(-40, 40), min_size=5, max_size=5),
    st.sampled_from(["group", "none"]),
)
def test_advantages_invariant_to_per_group_shift(data, shifts, norm):
    r, g, _ = data
    cfg = AdvantageConfig(norm=norm)
    shifted = r + torch.tensor(shifts, dtype=F64)[g] / 4
    torch.testing.assert_close(
        group_advantages(shifted, g, cfg), group_advantages(r, g, cfg), atol=1e-12, rtol=0
    )


@given(grouped_rewards(), st.sampled_from([0.5, 2.0, 3.0, 1000.0]), st.sampled_from(["group", "batch"]))
def test_advantages_invariant_to_positive_scaling_when_std_normalised(data, scale, norm):
    r, g, _ = data
    cfg = AdvantageConfig(norm=norm, eps=0.0)  # eps breaks exact scale invariance; test it without
    torch.testing.assert_close(
        group_advantages(r * scale, g, cfg), group_advantages(r, g, cfg), atol=1e-12, rtol=1e-12
    )


@given(st.integers(1, 8), st.integers(-8, 8), st.sampled_from([0.0, 1e-6]), st.booleans())
def test_zero_variance_group_is_exactly_zero(size, value, eps, unbiased):
    # a zero-variance group next to a normal one; also the singleton case (size == 1)
    r = torch.tensor([value / 3] * size + [0.0, 1.0, 3.0], dtype=F64)
    g = torch.tensor([0] * size + [1, 1, 1])
    for norm in ("group", "batch", "none"):
        adv = group_advantages(r, g, AdvantageConfig(norm=norm, eps=eps, unbiased_std=unbiased))
        assert adv[:size].tolist() == [0.0] * size
        assert not bool(adv.isnan().any())


@given(grouped_rewards())
def test_advantages_do_not_depend_on_row_order(data):
    r, g, _ = data
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(len(r)))
    adv = group_advantages(r, g)
    torch.testing.assert_close(group_advantages(r[perm], g[perm]), adv[perm], atol=1e-15, rtol=0)


# ----------------------------------------------------------------------------- loss: naive loop


def _naive_loss(logps, old, adv, mask, cfg: LossConfig, ref=None, num_tokens=None, num_seqs=None):
    """A plain Python loop over tokens, written from the formulas (autograd through scalars)."""
    n, t = logps.shape
    rows, n_tok, n_seq = [], 0.0, 0.0
    total = logps.sum() * 0.0  # part of the graph even when every token is masked
    for i in range(n):
        row_sum, row_tok = logps.new_zeros(()), 0.0
        for j in range(t):
            if not mask[i][j]:
                continue
            a = adv[i] if adv.ndim == 1 else adv[i][j]
            lr = logps[i][j] - old[i][j]
            if cfg.log_ratio_clamp is not None:
                lr = lr.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
            rho = torch.exp(lr)
            clipped = rho.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
            tok = -torch.minimum(rho * a, clipped * a)
            if cfg.dual_clip is not None and a < 0:
                tok = torch.minimum(tok, -a * cfg.dual_clip)
            if cfg.kl_coef > 0:
                d = logps[i][j] - ref[i][j]
                if cfg.kl_estimator == "k1":
                    kl = d
                elif cfg.kl_estimator == "k2":
                    kl = 0.5 * d * d
                else:
                    e = (-d).clamp(-20, 20)
                    kl = (torch.exp(e) - e - 1).clamp(-10, 10)
                tok = tok + cfg.kl_coef * kl
            row_sum = row_sum + tok
            row_tok += 1
        n_tok += row_tok
        if row_tok > 0:
            n_seq += 1
            rows.append((row_sum, row_tok))
    if num_tokens is not None:
        n_tok = num_tokens
    if num_seqs is not None:
        n_seq = num_seqs
    if cfg.agg == "token-mean":
        for s, _ in rows:
            total = total + s
        return total / max(n_tok, 1.0)
    for s, k in rows:
        total = total + (s / k if cfg.agg == "seq-mean-token-mean" else s)
    total = total / max(n_seq, 1.0)
    if cfg.agg == "seq-mean-token-sum-norm":
        total = total / (cfg.norm_constant if cfg.norm_constant is not None else t)
    return total


@st.composite
def loss_case(draw):
    n, t = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, t, generator=gen, dtype=F64) * 3
    old = logps + torch.randn(n, t, generator=gen, dtype=F64) * draw(st.sampled_from([0.05, 0.3, 1.0]))
    ref = logps + torch.randn(n, t, generator=gen, dtype=F64) * 0.5
    mask = (torch.rand(n, t, generator=gen) < draw(st.sampled_from([0.5, 0.8, 1.0]))).long()
    per_token_adv = draw(st.booleans())
    adv = torch.randn((n, t) if per_token_adv else (n,), generator=gen, dtype=F64)
    agg = draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]))
    cfg = LossConfig(
        eps_low=draw(st.sampled_from([0.1, 0.2, 0.28])),
        eps_high=draw(st.sampled_from([0.2, 0.28, 0.5])),
        dual_clip=draw(st.sampled_from([None, 1.5, 3.0])),
        kl_coef=draw(st.sampled_from([0.0, 0.04, 0.5])),
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3"])),
        agg=agg,
        norm_constant=draw(st.sampled_from([None, 7.0])) if agg == "seq-mean-token-sum-norm" else None,
    )
    counts = {}
    if draw(st.booleans()):
        counts = {"num_tokens": 11.0} if agg == "token-mean" else {"num_seqs": 6.0}
    return logps, old, ref, mask, adv, cfg, counts


@given(loss_case())
def test_loss_and_grad_match_naive_loop(case):
    logps, old, ref, mask, adv, cfg, counts = case
    x = logps.clone().requires_grad_(True)
    out = grpo_loss(x, old, adv, mask, cfg, ref, **counts)
    (g,) = torch.autograd.grad(out.loss, x)
    y = logps.clone().requires_grad_(True)
    want = _naive_loss(y, old, adv, mask, cfg, ref, **counts)
    (g_want,) = torch.autograd.grad(want, y)
    torch.testing.assert_close(out.loss.detach(), want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g, g_want, atol=1e-12, rtol=1e-12)


@given(loss_case(), st.integers(0, 2**16))
def test_masked_entries_change_nothing(case, seed):
    logps, old, ref, mask, adv, cfg, counts = case
    gen = torch.Generator().manual_seed(seed)
    off = mask == 0

    def junk(x):  # arbitrary values (also large ones) at masked positions only
        return torch.where(off, torch.randn(x.shape, generator=gen, dtype=F64) * 30, x)

    x1, x2 = logps.clone().requires_grad_(True), junk(logps).requires_grad_(True)
    a1 = adv if adv.ndim == 1 else adv
    a2 = adv if adv.ndim == 1 else junk(adv)
    o1 = grpo_loss(x1, old, a1, mask, cfg, ref, **counts)
    o2 = grpo_loss(x2, junk(old), a2, mask, cfg, junk(ref), **counts)
    (g1,) = torch.autograd.grad(o1.loss, x1)
    (g2,) = torch.autograd.grad(o2.loss, x2)
    assert o1.loss.item() == o2.loss.item()
    assert torch.equal(g1, g2)
    assert bool((g1[off] == 0).all())
    assert o1.kl == o2.kl and o1.clip_fraction == o2.clip_fraction


def test_masked_inf_or_nan_at_padding_does_not_leak():
    """Padding positions of a model's log-probs can hold anything (even -inf): the loss stays finite."""
    logps = torch.tensor([[-1.0, float("-inf")], [-0.5, float("nan")]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, 0.0], [-0.4, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0], [1, 0]])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        cfg = LossConfig(agg=agg, kl_coef=0.1, kl_estimator="k2")
        out = grpo_loss(logps, old, torch.tensor([1.0, -1.0], dtype=F64), mask, cfg, old.clone())
        (g,) = torch.autograd.grad(out.loss, logps)
        assert math.isfinite(out.loss.item()) and math.isfinite(out.kl), agg
        assert bool(torch.isfinite(g).all()) and g[:, 1].tolist() == [0.0, 0.0], agg


def test_loss_float32_close_to_float64():
    gen = torch.Generator().manual_seed(0)
    logps = -torch.rand(6, 9, generator=gen, dtype=F64)
    old = logps + 0.1 * torch.randn(6, 9, generator=gen, dtype=F64)
    mask = (torch.rand(6, 9, generator=gen) < 0.8).long()
    adv = torch.randn(6, generator=gen, dtype=F64)
    cfg = LossConfig(kl_coef=0.1)
    hi = grpo_loss(logps, old, adv, mask, cfg, old).loss
    lo = grpo_loss(logps.float(), old.float(), adv.float(), mask, cfg, old.float()).loss
    assert lo.dtype == torch.float32
    assert abs(lo.item() - hi.item()) < 1e-6
