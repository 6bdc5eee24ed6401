"""grpo_parts.core against OpenRLHF 0.11.2's own loss, KL and advantage code, live, in float64.

``openrlhf.models.loss.PolicyLoss`` (``ppo`` with dual-clip and every ratio-gated
``is_correction`` setting, ``gspo``), ``openrlhf.models.utils.compute_approx_kl`` (k1/k2/k3 and
their +-10 clamps), the actor step's KL-loss and entropy terms (``aggregate_loss``, composed as
``PPOActor.training_step`` composes them: the step itself needs a DeepSpeed model), and
``RemoteExperienceMaker.compute_advantages_and_returns`` (called unbound: ``group_norm``, ``rloo``,
``reinforce_baseline``, ``dr_grpo``, ``reward.clip_range``, KL in the reward as per-token rewards).
Losses, gradients and advantages agree to 1e-12 (absolute) on hypothesis-drawn inputs with ragged
masks, length-1 rows, fully masked rows, clipping on both sides and zero-variance groups. Two
documented exceptions, both where OpenRLHF casts to float32 (``.float()``) whatever the input dtype:
``compute_approx_kl`` (so the KL values, and the actor loss with a KL term, are compared at float32
resolution, 1e-6 relative; the advantage pipeline is fed the float64 KL so that it is compared at
1e-12), and ``reinforce_baseline``'s whitening statistics (compared at 1e-6 relative).

OpenRLHF's groups have one fixed size (``n_samples_per_prompt``, >= 2); its ``flash_attn``/``vllm``
imports are stood in by this package's conftest. It is installed by scripts/ci/install-dev.sh, so
these tests run (never skip) in CI.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _openrlhf_helpers import openrlhf_args
from core_cases import F64, TOL, Case, assert_close, cases, grpo_loss_and_grads, loss_and_grads
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.core import (
    AdvantageConfig,
    CorrectionConfig,
    LossConfig,
    compute_advantages,
    grpo_loss,
    kl_estimate,
)

#: relative resolution of a float32 computation (OpenRLHF's .float() casts)
F32_RES = 1e-6
#: OpenRLHF (is_correction_level, mode, threshold) -> our correction
IS = {
    "off": ("off", "mask", [0.5, 5.0], CorrectionConfig()),
    "token-clip": ("token", "clip", [0.7, 1.6], CorrectionConfig(level="token", low=0.7, high=1.6, log_ratio_clamp=None)),
    "token-mask": ("token", "mask", [0.7, 1.6], CorrectionConfig(level="token", mode="mask", low=0.7, high=1.6, log_ratio_clamp=None)),
    "seq-mask": ("seq", "mask", [0.85, 1.2], CorrectionConfig(level="sequence", mode="mask", low=0.85, high=1.2,
                                                               seq_log_ratio="mean", mask_weight="token", log_ratio_clamp=None)),
}  # fmt: skip


@pytest.fixture(scope="module")
def orl():
    from openrlhf.models.loss import PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl

    return SimpleNamespace(PolicyLoss=PolicyLoss, aggregate_loss=aggregate_loss, kl=compute_approx_kl)


def _agg(token_level: bool) -> dict:
    return {"agg": "token-mean"} if token_level else {"agg": "seq-mean-token-mean", "seq_len_eps": 1e-8}


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("is_key", list(IS))
@settings(derandomize=True, deadline=None, max_examples=20)
@given(c=cases(), dual=st.sampled_from([None, 1.5, 3.0]), eps=st.sampled_from([(0.2, 0.2), (0.1, 0.28)]))
def test_ppo_policy_loss_matches_openrlhf(orl, token_level, is_key, c: Case, dual, eps):
    level, mode, thr, corr = IS[is_key]
    fn = orl.PolicyLoss(eps[0], eps[1], dual, token_level, "ppo", level, mode, "ratio", thr)
    m = c.mask.to(F64)
    want = loss_and_grads(lambda x: fn(x, c.old, c.adv_tokens(), m, rollout_log_probs=c.rollout)[0], c.logps)
    cfg = LossConfig(eps_low=eps[0], eps_high=eps[1], dual_clip=dual, correction=corr, **_agg(token_level))
    got = loss_and_grads(
        lambda x: grpo_loss(x, c.old, c.adv, c.mask, cfg, rollout_logps=c.rollout).loss, c.logps
    )
    assert_close(got[0], want[0], what="loss")
    assert_close(got[1], want[1], what="grad logps")


@pytest.mark.parametrize("is_on", [False, True])
@settings(derandomize=True, deadline=None, max_examples=25)
@given(c=cases(), dual=st.sampled_from([None, 1.5]), eps=st.sampled_from([(3e-4, 4e-4), (0.2, 0.2)]))
def test_gspo_matches_openrlhf(orl, is_on, c: Case, dual, eps):
    """OpenRLHF's GSPO: sequence ratio, per-sample mean; with is_correction its ratio is taken against
    the sampler's log-probs instead of the old policy's -- ours with ``old_logps=rollout_logps``."""
    fn = orl.PolicyLoss(
        eps[0], eps[1], dual, True, "gspo", "token" if is_on else "off", "mask", "ratio", [0.5, 5.0]
    )
    m = c.mask.to(F64)
    want = loss_and_grads(lambda x: fn(x, c.old, c.adv_tokens(), m, rollout_log_probs=c.rollout)[0], c.logps)
    cfg = LossConfig(
        policy="gspo", eps_low=eps[0], eps_high=eps[1], dual_clip=dual, log_ratio_clamp=None, **_agg(False)
    )
    old = c.rollout if is_on else c.old
    got = loss_and_grads(lambda x: grpo_loss(x, old, c.adv, c.mask, cfg).loss, c.logps)
    assert_close(got[0], want[0], what="loss")
    assert_close(got[1], want[1], what="grad logps")


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@settings(derandomize=True, deadline=None, max_examples=25)
@given(c=cases())
def test_approx_kl_matches_openrlhf(orl, est, c: Case):
    ref = c.ref.clone()
    k = min(3, ref.numel())  # push some tokens past every clamp (k3 > 10, |k1| > 10, k2 > 10)
    ref.view(-1)[:k] = c.logps.view(-1)[:k] + torch.tensor([6.0, -15.0, 25.0], dtype=F64)[:k]
    want = orl.kl(c.logps, ref, kl_estimator=est).double()
    got = kl_estimate(c.logps, ref, est, "all")  # type: ignore[arg-type]
    assert float(want.abs().max()) <= 10.0 and float(got.abs().max()) <= 10.0
    assert_close(got, want, tol=F32_RES * 10, what="kl")  # OpenRLHF computes in float32
    g_want = loss_and_grads(lambda x: orl.kl(x, ref, kl_estimator=est).sum(), c.logps)[1]
    g_got = loss_and_grads(lambda x: kl_estimate(x, ref, est, "all").sum(), c.logps)[1]  # type: ignore[arg-type]
    assert_close(g_got, g_want, tol=F32_RES * max(1.0, float(g_want.abs().max())), what="grad logps")


@settings(derandomize=True, deadline=None, max_examples=25)
@given(
    c=cases(),
    token_level=st.booleans(),
    kl=st.sampled_from([(0.0, "k1"), (0.05, "k1"), (0.1, "k2"), (0.04, "k3")]),
    ent_coef=st.sampled_from([0.0, 0.01]),
)
def test_actor_loss_with_kl_and_entropy_matches_openrlhf(orl, c: Case, token_level, kl, ent_coef):
    """The actor step: policy loss + kl_coef * token-mean(KL) - entropy_coef * token-mean(H)."""
    kl_coef, est = kl
    m = c.mask.to(F64)
    policy = orl.PolicyLoss(0.2, 0.28, None, token_level)

    def openrlhf_loss(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        loss = policy(x, c.old, c.adv_tokens(), m)[0]
        loss = loss + orl.aggregate_loss(orl.kl(x, c.ref, kl_estimator=est), m) * kl_coef
        return loss - orl.aggregate_loss(h, m) * ent_coef

    want = loss_and_grads(openrlhf_loss, c.logps, c.entropy)
    cfg = LossConfig(
        eps_high=0.28, kl_coef=kl_coef, kl_estimator=est, kl_clamp="all", kl_agg="token-mean",  # type: ignore[arg-type]
        entropy_coef=ent_coef, entropy_agg="token-mean", **_agg(token_level),
    )  # fmt: skip
    got = grpo_loss_and_grads(c, cfg, with_ref=bool(kl_coef))
    for g, w, what in zip(got, want, ("loss", "grad logps", "grad entropy")):
        # compute_approx_kl works in float32: with a KL term only float32 resolution is meaningful
        tol = F32_RES * max(1.0, float(w.abs().max())) if kl_coef else TOL
        assert_close(g, w, tol=tol, what=what)


# ------------------------------------------------------------------------- advantages

OURS = {
    "group_norm": AdvantageConfig(eps=1e-9),
    "dr_grpo": AdvantageConfig(norm="none"),
    "rloo": AdvantageConfig(estimator="rloo"),
    "reinforce_baseline": AdvantageConfig(estimator="reinforce_plus_plus_baseline", whiten="openrlhf"),
}


def _openrlhf_advantages(
    c: Case, estimator: str, clip: tuple[float, float], kl_coef: float, kl: torch.Tensor
):
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    n = int(torch.bincount(c.group)[0])
    args = openrlhf_args(
        n, int(c.group.max()) + 1, **{"algo.advantage.estimator": estimator, "reward.clip_range": clip}
    )
    maker = object.__new__(
        RemoteExperienceMaker
    )  # only strategy.args, kl_ctl and advantage_estimator are read
    maker.strategy, maker.args = SimpleNamespace(args=args), args
    maker.kl_ctl, maker.advantage_estimator = SimpleNamespace(value=kl_coef), estimator
    exp = Experience(
        action_mask=c.mask.bool(), rewards=c.rewards.clone(), kl=kl, index=list(range(len(c.group)))
    )
    (out,) = maker.compute_advantages_and_returns([exp])
    return out.advantages


@pytest.mark.parametrize("estimator", list(OURS))
@settings(derandomize=True, deadline=None, max_examples=25)
@given(
    c=cases(min_group_size=2, fixed_group_size=True),
    clip=st.sampled_from([(-10.0, 10.0), (-0.5, 0.75)]),
    kl=st.sampled_from([(0.0, "k1"), (0.05, "k1"), (0.1, "k3")]),
)
def test_advantages_match_openrlhf(estimator, c: Case, clip, kl):
    kl_coef, est = kl
    # make_experience's KL (rollout-time policy vs reference), in float64: compute_approx_kl would cast
    # it to float32, and its values are checked against kl_estimate(clamp="all") above
    kl_tok = kl_estimate(c.old, c.ref, est, "all")  # type: ignore[arg-type]
    want = _openrlhf_advantages(c, estimator, clip, kl_coef, kl_tok)
    upd = {
        "reward_clip": clip,
        "kl_coef": kl_coef,
        "kl_estimator": est,
        "kl_clamp": "all",
        "kl_placement": "token",
    }
    cfg = OURS[estimator].model_copy(update=upd)
    got = compute_advantages(c.rewards, c.group, c.mask, cfg, old_logps=c.old, ref_logps=c.ref)
    m = c.mask.to(F64)
    got = (got if got.ndim == 2 else got[:, None]) * m
    tol = TOL
    if estimator == "reinforce_baseline":  # OpenRLHF whitens with float32 statistics
        tol = F32_RES * max(1.0, float(want.abs().max()))
    assert_close(got, want * m, tol=tol, what=f"advantages {estimator}")
