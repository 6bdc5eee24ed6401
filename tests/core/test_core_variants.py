"""The GRPO variants of grpo_parts.core against verl 0.9.1's own functions, live, in float64.

verl ``core_algos`` policy-loss registry (``vanilla``, ``gspo``, ``cispo``, ``sapo``), its
advantage estimators (``grpo``, ``rloo``, ``reinforce_plus_plus_baseline``), ``kl_penalty``,
``agg_loss``, ``ray_trainer.apply_kl_penalty`` (KL in the reward) and ``rollout_corr_helper``
(truncated / masked importance sampling at token and sequence level). Losses, gradients (w.r.t. the
log-probs and the entropy) and advantages agree to 1e-12 (absolute) on hypothesis-drawn inputs:
ragged masks, length-1 rows, fully masked rows, clipping on both sides, dual-clip, zero-variance
groups and groups of one.

``verl.workers.utils.losses.ppo_loss`` takes the engine's unpadded model output (nested tensors),
so the entropy/KL test composes the three ``core_algos`` calls it makes (policy loss, ``agg_loss``
of the entropy with ``loss_agg_mode``, ``agg_loss`` of ``kl_penalty``) on padded tensors.
The one documented difference: a singleton group under GRPO's std scaling, where verl divides by a
float32 ``1 + eps`` (checked at that size below). verl is installed by scripts/ci/install-dev.sh, so
these tests run (never skip) in CI.
"""

from __future__ import annotations

import pytest
import torch
from core_cases import F64, Case, assert_close, cases, grpo_loss_and_grads, loss_and_grads
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.core import (
    AdvantageConfig,
    CorrectionConfig,
    LossConfig,
    compute_advantages,
    correction_weights,
    grpo_loss,
)

pytestmark = pytest.mark.frameworks
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
#: (verl rollout_is, threshold) -> our CorrectionConfig; None = no correction
CORRECTIONS = {
    "none": None,
    "token-tis": ("token", 1.3, CorrectionConfig(level="token", mode="truncate", high=1.3)),
    "token-icepop": ("token", "0.8_1.25", CorrectionConfig(level="token", mode="mask", low=0.8, high=1.25)),
    "seq-tis": ("sequence", 2.0, CorrectionConfig(level="sequence", mode="truncate", high=2.0)),
    "seq-icepop": ("sequence", "0.5_2.0", CorrectionConfig(level="sequence", mode="mask", low=0.5, high=2.0)),
}


@pytest.fixture(scope="module")
def verl():
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty

    return core_algos, rollout_corr_helper, apply_kl_penalty


def _actor_config(eps_low: float, eps_high: float, clip_c: float = 3.0, **kw):
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp", clip_ratio=0.2, clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=clip_c,
        rollout_n=4, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, **kw,
    )  # fmt: skip


def _verl_weights(rc, c: Case, spec):
    if spec is None:
        return None
    level, threshold, _ = spec
    try:
        w, _ = rc.compute_rollout_correction_weights(c.old - c.rollout, c.mask.to(F64), level, threshold)
    except ZeroDivisionError:
        # verl's effective-sample-size metric divides by the mean weight: it raises exactly when
        # masking rejected every token, i.e. when the weights are all zero
        return torch.zeros(c.mask.shape, dtype=F64)
    return w


# ------------------------------------------------------------------------- policy losses (+ correction)

VERL_POLICY = {"vanilla": "clip", "gspo": "gspo_token", "cispo": "cispo", "sapo": "sapo"}


def _our_policy_config(
    mode: str, agg: str, eps_low: float, eps_high: float, clip_c: float, corr
) -> LossConfig:
    if mode == "sapo":
        agg = "seq-mean-token-mean"  # verl's sapo always aggregates seq-mean-token-mean
    return LossConfig(
        policy=VERL_POLICY[mode],  # type: ignore[arg-type]
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=clip_c if mode == "vanilla" else None,  # verl applies clip_ratio_c in vanilla only
        log_ratio_clamp=10.0 if mode == "gspo" else 20.0,  # verl's gspo clamps log s_i at 10 (from above)
        agg=agg,  # type: ignore[arg-type]
        seq_len_eps=1e-8 if agg == "seq-mean-token-mean" else 0.0,  # verl: count + 1e-8
        correction=CorrectionConfig() if corr is None else corr[2],
    )


@pytest.mark.parametrize("mode", list(VERL_POLICY))
@pytest.mark.parametrize("agg", AGGS)
@settings(derandomize=True, deadline=None, max_examples=12)
@given(
    c=cases(),
    clip=st.sampled_from([(0.2, 0.2, 3.0), (0.1, 0.28, 1.5), (0.2, 0.3, 1.2)]),
    corr=st.sampled_from(list(CORRECTIONS)),
)
def test_policy_loss_matches_verl(verl, mode, agg, c: Case, clip, corr):
    core_algos, rc, _ = verl
    eps_low, eps_high, clip_c = clip
    spec = CORRECTIONS[corr]
    vcfg = _actor_config(eps_low, eps_high, clip_c)
    fn = core_algos.get_policy_loss_fn(mode)
    weights = _verl_weights(rc, c, spec)
    m = c.mask.to(F64)
    want = loss_and_grads(
        lambda x: fn(c.old, x, c.adv_tokens(), m, loss_agg_mode=agg, config=vcfg, rollout_is_weights=weights)[
            0
        ],
        c.logps,
    )
    cfg = _our_policy_config(mode, agg, eps_low, eps_high, clip_c, spec)
    got = loss_and_grads(
        lambda x: grpo_loss(x, c.old, c.adv, c.mask, cfg, rollout_logps=c.rollout).loss, c.logps
    )
    assert_close(got[0], want[0], what="loss")
    assert_close(got[1], want[1], what="grad logps")


@settings(derandomize=True, deadline=None, max_examples=30)
@given(c=cases(), corr=st.sampled_from([k for k in CORRECTIONS if k != "none"]))
def test_correction_weights_match_verl(verl, c: Case, corr):
    _, rc, _ = verl
    spec = CORRECTIONS[corr]
    ours = correction_weights(c.old, c.rollout, c.mask, spec[2])
    assert ours is not None
    assert_close(ours, _verl_weights(rc, c, spec), what="weights")


# ------------------------------------------------------------------------- entropy bonus and KL loss


@pytest.mark.parametrize("agg", AGGS)
@settings(derandomize=True, deadline=None, max_examples=15)
@given(
    c=cases(),
    ent_coef=st.sampled_from([0.0, 0.01, 0.3]),
    kl=st.sampled_from([(0.0, "k3"), (0.05, "k1"), (0.1, "k2"), (0.04, "k3")]),
)
def test_entropy_and_kl_loss_match_verl_ppo_loss(verl, agg, c: Case, ent_coef, kl):
    """verl ``ppo_loss``: pg_loss - entropy_coeff * agg(H) + kl_loss_coef * agg(kl_penalty)."""
    core_algos, _, _ = verl
    kl_coef, kl_type = kl
    m = c.mask.to(F64)
    vcfg = _actor_config(0.2, 0.28)

    def verl_loss(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        pg, _ = core_algos.compute_policy_loss_vanilla(c.old, x, c.adv_tokens(), m, agg, vcfg)
        loss = pg - ent_coef * core_algos.agg_loss(h, m, agg)
        kld = core_algos.kl_penalty(x, c.ref, kl_type)
        return loss + kl_coef * core_algos.agg_loss(kld, m, agg)

    want = loss_and_grads(verl_loss, c.logps, c.entropy)
    cfg = LossConfig(
        eps_high=0.28, dual_clip=3.0, agg=agg, seq_len_eps=1e-8 if agg == "seq-mean-token-mean" else 0.0,  # type: ignore[arg-type]
        kl_coef=kl_coef, kl_estimator=kl_type, entropy_coef=ent_coef,  # type: ignore[arg-type]
    )  # fmt: skip
    got = grpo_loss_and_grads(c, cfg, with_ref=bool(kl_coef))
    for g, w, what in zip(got, want, ("loss", "grad logps", "grad entropy")):
        assert_close(g, w, what=what)


# ------------------------------------------------------------------------- advantage estimators


def _verl_advantages(core_algos, name: str, c: Case, scores_tok: torch.Tensor, eps: float, norm: bool):
    m = c.mask.to(F64)
    fn = core_algos.get_adv_estimator_fn(name)
    kwargs = {"norm_adv_by_std_in_grpo": norm} if name == "grpo" else {}
    adv, _ = fn(scores_tok, m, c.index, epsilon=eps, **kwargs)
    return adv


def _token_scores(c: Case) -> torch.Tensor:
    """The outcome reward on each row's last token (verl's token_level_scores)."""
    scores = torch.zeros(c.mask.shape, dtype=F64)
    last = (c.mask.sum(-1) - 1).clamp(min=0)
    scores[torch.arange(len(last)), last] = c.rewards * (c.mask.sum(-1) > 0)
    return scores


ESTIMATORS = {
    "grpo": AdvantageConfig(estimator="grpo", singleton="reward"),
    "grpo-dr": AdvantageConfig(estimator="grpo", norm="none", singleton="reward"),
    "rloo": AdvantageConfig(estimator="rloo", singleton="reward"),
    "reinforce_plus_plus_baseline": AdvantageConfig(
        estimator="reinforce_plus_plus_baseline", singleton="reward"
    ),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
@settings(derandomize=True, deadline=None, max_examples=25)
@given(
    c=cases(empty_rows=False),
    eps=st.sampled_from([1e-6, 1e-4]),
    kl=st.sampled_from([(0.0, "k1"), (0.05, "k1"), (0.1, "k3"), (0.02, "k2")]),
)
def test_advantages_match_verl(verl, name, c: Case, eps, kl):
    """Estimators with KL in the reward (verl ``apply_kl_penalty`` on the rollout policy's log-probs)."""
    from verl.protocol import DataProto

    core_algos, _, apply_kl_penalty = verl
    kl_coef, est = kl
    if name == "reinforce_plus_plus_baseline" and int(c.mask.sum()) < 2:
        return  # verl's masked_whiten raises on a one-token batch
    scores = _token_scores(c)
    if kl_coef:
        data = DataProto.from_dict(
            tensors={"response_mask": c.mask.to(F64), "token_level_scores": scores, "old_log_probs": c.old,
                     "ref_log_prob": c.ref},
        )  # fmt: skip
        scores = apply_kl_penalty(data, core_algos.FixedKLController(kl_coef), est)[0].batch[
            "token_level_rewards"
        ]
    want = _verl_advantages(core_algos, name.replace("grpo-dr", "grpo"), c, scores, eps, name != "grpo-dr")
    upd = {"eps": eps, "kl_coef": kl_coef, "kl_estimator": est, "kl_placement": "sequence"}
    cfg = ESTIMATORS[name].model_copy(update=upd)
    ours = compute_advantages(c.rewards, c.group, c.mask, cfg, old_logps=c.old, ref_logps=c.ref)
    got = ours[:, None] * c.mask.to(F64)
    lone = torch.bincount(c.group)[c.group] == 1
    if name == "grpo" and bool(lone.any()):
        # verl builds a singleton's std as float32 1.0, so its 1 + eps is float32-rounded (documented)
        f32 = float(torch.tensor(1.0) + eps)
        assert_close(want[lone], got[lone] * (1 + eps) / f32, tol=1e-12, what="singleton")
        want, got = want[~lone], got[~lone]
    assert_close(got, want, what=f"advantages {name}")


@settings(derandomize=True, deadline=None, max_examples=20)
@given(c=cases(empty_rows=False, min_group_size=2))
def test_zero_variance_and_singleton_conventions(c: Case):
    """Our default: a group of one gets 0; a zero-variance group gets exactly 0 under every estimator."""
    counts = torch.bincount(c.group)[c.group]
    for est in ("grpo", "rloo"):
        ours = compute_advantages(c.rewards, c.group, c.mask, AdvantageConfig(estimator=est))  # type: ignore[arg-type]
        gmax = torch.zeros(len(counts), dtype=F64).scatter_reduce(
            0, c.group, c.rewards, "amax", include_self=False
        )
        gmin = torch.zeros(len(counts), dtype=F64).scatter_reduce(
            0, c.group, c.rewards, "amin", include_self=False
        )
        zero = (gmax == gmin)[c.group]
        assert bool((ours[zero] == 0).all())
    lone = torch.tensor([0.75, -0.5, 0.25], dtype=F64)
    out = compute_advantages(lone, torch.arange(3), torch.ones(3, 2), AdvantageConfig(estimator="rloo"))
    assert out.tolist() == [0.0, 0.0, 0.0]
