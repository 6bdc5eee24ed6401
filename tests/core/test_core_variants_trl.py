"""The GRPO variants of grpo_parts.core against TRL 1.16's ``GRPOTrainer._compute_loss``, live, in float64.

``_compute_loss`` is called unbound on a stand-in carrying only the attributes it reads (as in
tests/core/test_core_agreement.py): every ``loss_type`` (``grpo``, ``bnpo``, ``dapo``, ``dr_grpo``,
``cispo`` -- also at TRL's default ``epsilon_high`` (0.2, a cap below 1) and at 0.2, 0.8, 5.0 --,
``sapo``), ``importance_sampling_level`` token and sequence (GSPO), ``beta`` with and
without ``use_bias_correction_kl``, the entropy bonus, and the vLLM importance-sampling ratio.
Losses and gradients (w.r.t. the log-probs and the entropies) agree to 1e-12 (absolute) on
hypothesis-drawn inputs with ragged masks, length-1 rows and fully masked rows (as
``mask_truncated_completions`` produces).

TRL computes the vLLM importance-sampling ratio inline in ``_generate_and_score_completions``,
which needs a generation backend, so it cannot be called here: ``_compute_loss`` is fed our
``correction_weights`` for each of TRL's four modes (checking how the ratio enters the loss), and
the weights themselves are checked against the functions that compute the same thing (verl's
``compute_rollout_correction_weights`` in tests/core/test_core_variants.py, OpenRLHF's ``PolicyLoss`` in
tests/adapters/openrlhf/test_core_agreement_openrlhf.py). TRL is installed by scripts/ci/install-dev.sh,
so these tests run (never skip) in CI.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from core_cases import Case, assert_close, cases, loss_and_grads
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.core import CorrectionConfig, LossConfig, correction_weights, grpo_loss

pytestmark = pytest.mark.frameworks
MAX_LEN = 9  # TRL's max_completion_length (dr_grpo's constant)
#: TRL builds SAPO's temperatures with torch.where on Python floats, i.e. as float32: its default 1.05
#: becomes 1.0499999523 (a 5e-8 relative change of the gate); a float32-exact tau compares exactly
SAPO_TAU_NEG = 1.25
#: TRL's cispo caps the ratio at epsilon_high (absolute, no lower bound): our ``cispo_max``
CISPO_EPS_HIGH = 2.0
#: TRL vllm_importance_sampling_mode -> our correction (clip_min 0.7, clip_max 1.6 / 3.0)
IS_MODES = {
    "off": CorrectionConfig(),
    "token_truncate": CorrectionConfig(level="token", low=0.7, high=1.6, log_ratio_clamp=None),
    "token_mask": CorrectionConfig(level="token", mode="mask", low=0.7, high=1.6, log_ratio_clamp=None),
    "sequence_truncate": CorrectionConfig(level="sequence", low=0.7, high=3.0, log_ratio_clamp=None),
    "sequence_mask": CorrectionConfig(level="sequence", mode="mask", low=0.7, high=3.0, log_ratio_clamp=None),
}


@pytest.fixture(scope="module")
def trl_compute_loss():
    from trl import GRPOTrainer

    return GRPOTrainer._compute_loss


class _StandIn:
    """Just what ``_compute_loss`` reads (TRL 1.16); ``_get_per_token_logps_and_entropies`` returns our tensors."""

    def __init__(
        self, loss_type: str, level: str, beta: float, bias_kl: bool, ent_coef: float, is_on: bool, x, h,
        epsilon_high: float | None = None,
    ):  # fmt: skip
        self.loss_type, self.importance_sampling_level, self.beta = loss_type, level, beta
        self.epsilon_low = 0.2
        self.epsilon_high = epsilon_high or (CISPO_EPS_HIGH if loss_type == "cispo" else 0.28)
        self.max_completion_length = MAX_LEN
        self.aux_loss_enabled, self.top_entropy_quantile, self.off_policy_mask_threshold = False, 1.0, None
        self.use_vllm = self.vllm_importance_sampling_correction = is_on
        self._entropy_bonus_enabled, self.entropy_coef, self.use_adaptive_entropy = (
            ent_coef > 0,
            ent_coef,
            False,
        )
        self.model = SimpleNamespace(training=True)
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(
            use_bias_correction_kl=bias_kl, delta=None, steps_per_generation=1,
            sapo_temperature_pos=1.0, sapo_temperature_neg=SAPO_TAU_NEG,
        )  # fmt: skip
        self.accelerator = SimpleNamespace(
            num_processes=1, gather=lambda v: v, gather_for_metrics=lambda v: v,
            reduce=lambda v, reduction="sum": v, sync_gradients=True,
        )  # fmt: skip
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._x, self._h = x, h

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return self._x, self._h, None


def _ours(loss_type: str, level: str, beta: float, bias_kl: bool, ent_coef: float, corr: CorrectionConfig):
    """TRL's settings as a LossConfig (docs/core_maths.md has the table)."""
    policy = {"cispo": "cispo", "sapo": "sapo"}.get(loss_type, "gspo" if level == "sequence" else "clip")
    agg = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
    return LossConfig(
        policy=policy,  # type: ignore[arg-type]
        **({"cispo_max": CISPO_EPS_HIGH} if loss_type == "cispo" else {"eps_high": 0.28}),
        log_ratio_clamp=None,
        kl_coef=beta, kl_estimator="k3", kl_clamp="none", kl_ratio_weight=bias_kl,
        entropy_coef=ent_coef, entropy_agg="token-mean", sapo_tau_neg=SAPO_TAU_NEG,
        agg=agg.get(loss_type, "token-mean"),  # type: ignore[arg-type]
        norm_constant=float(MAX_LEN) if loss_type == "dr_grpo" else None,
        seq_count="all" if loss_type in agg else "nonempty",  # TRL averages over all rows, empty ones too
        correction=corr,
    )  # fmt: skip


def _inputs(c: Case, is_ratio: torch.Tensor | None) -> dict:
    n, t = c.mask.shape
    out = {
        "prompt_ids": torch.ones(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.ones(n, t, dtype=torch.long), "completion_mask": c.mask, "advantages": c.adv,
        "old_per_token_logps": c.old, "ref_per_token_logps": c.ref, "num_items_in_batch": c.mask.sum(),
    }  # fmt: skip
    if is_ratio is not None:
        out["importance_sampling_ratio"] = is_ratio
    return out


LOSS_TYPES = [
    ("grpo", "token"),
    ("grpo", "sequence"),
    ("bnpo", "token"),
    ("dapo", "token"),
    ("dapo", "sequence"),
]
LOSS_TYPES += [("dr_grpo", "token"), ("dr_grpo", "sequence"), ("cispo", "token"), ("sapo", "token")]


@pytest.mark.parametrize("loss_type,level", LOSS_TYPES)
@settings(derandomize=True, deadline=None, max_examples=15)
@given(
    c=cases(),
    kl=st.sampled_from([(0.0, False), (0.04, False), (0.04, True)]),
    ent_coef=st.sampled_from([0.0, 0.05]),
    is_mode=st.sampled_from(list(IS_MODES)),
)
def test_loss_matches_trl(trl_compute_loss, loss_type, level, c: Case, kl, ent_coef, is_mode):
    beta, bias_kl = kl
    corr = IS_MODES[is_mode]
    weights = correction_weights(c.old, c.rollout, c.mask, corr)
    # TRL keeps a sequence ratio as [B, 1]; every token of a row carries it (empty rows: masked anyway)
    is_ratio = None if weights is None else (weights[:, :1] if corr.level == "sequence" else weights)

    def trl(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        stand_in = _StandIn(loss_type, level, beta, bias_kl, ent_coef, is_ratio is not None, x, h)
        return trl_compute_loss(stand_in, None, _inputs(c, is_ratio))

    want = loss_and_grads(trl, c.logps, c.entropy)
    cfg = _ours(loss_type, level, beta, bias_kl, ent_coef, corr)
    counts = {"num_tokens": float(c.mask.sum())} if loss_type in ("dapo", "cispo") else {}

    def ours(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        ref = c.ref if beta else None
        return grpo_loss(x, c.old, c.adv, c.mask, cfg, ref, entropy=h, rollout_logps=c.rollout, **counts).loss

    got = loss_and_grads(ours, c.logps, c.entropy)
    for g, w, what in zip(got, want, ("loss", "grad logps", "grad entropy")):
        assert_close(g, w, what=what)


@settings(derandomize=True, deadline=None, max_examples=20)
@given(c=cases())
def test_trl_k3_is_unclamped_with_kl_clamp_none(trl_compute_loss, c: Case):
    """TRL's k3 has no clamp: with ``kl_clamp="none"`` we match it where verl's clamps would bite."""
    ref = c.ref.clone()
    ref[0, 0] = c.logps[0, 0] + 4.0  # k3 = e^4 - 5 > 10: verl/OpenRLHF clamp it, TRL does not
    c2 = Case(**{**c.__dict__, "ref": ref})
    want = loss_and_grads(
        lambda x, h: trl_compute_loss(
            _StandIn("bnpo", "token", 0.1, False, 0.0, False, x, h), None, _inputs(c2, None)
        ),
        c.logps,
        c.entropy,
    )
    got = loss_and_grads(
        lambda x: (
            grpo_loss(
                x, c.old, c.adv, c.mask, _ours("bnpo", "token", 0.1, False, 0.0, CorrectionConfig()), ref
            ).loss
        ),
        c.logps,
    )
    assert_close(got[0], want[0], what="loss")
    assert_close(got[1], want[1], what="grad logps")
    clamped = LossConfig(kl_coef=0.1, kl_clamp="k3", log_ratio_clamp=None, eps_high=0.28)
    if int(c.mask[0, 0]):
        assert abs(float(grpo_loss(c.logps, c.old, c.adv, c.mask, clamped, ref).loss - want[0])) > 1e-6


def _trl_cispo_default_epsilon_high() -> float:
    """``epsilon_high`` as TRL's ``GRPOTrainer.__init__`` resolves it for a default ``GRPOConfig``."""
    import dataclasses
    import inspect

    from trl import GRPOConfig, GRPOTrainer

    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert fields["epsilon_high"] is None, "TRL's default epsilon_high changed: revisit the cispo mapping"
    # the line this mirrors (TRL 1.16): ``args.epsilon_high if args.epsilon_high is not None else args.epsilon``
    assert "args.epsilon_high if args.epsilon_high is not None else args.epsilon" in inspect.getsource(
        GRPOTrainer.__init__
    )
    return float(fields["epsilon"])


def _wide(c: Case) -> Case:
    """Ratios e^[-2, 2] (0.14 .. 7.4): every cap below is active on some tokens and not on others."""
    return Case(**{**c.__dict__, "old": c.logps + 2.5 * (c.old - c.logps)})


def _check_cispo(trl_compute_loss, c: Case, epsilon_high: float) -> None:
    def trl(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        stand_in = _StandIn("cispo", "token", 0.0, False, 0.0, False, x, h, epsilon_high=epsilon_high)
        return trl_compute_loss(stand_in, None, _inputs(c, None))

    want = loss_and_grads(trl, c.logps, c.entropy)
    cfg = LossConfig(policy="cispo", cispo_max=epsilon_high, log_ratio_clamp=None)
    got = loss_and_grads(
        lambda x: grpo_loss(x, c.old, c.adv, c.mask, cfg, num_tokens=float(c.mask.sum())).loss, c.logps
    )
    assert_close(got[0], want[0], what="loss")
    assert_close(got[1], want[1], what="grad logps")


def test_cispo_default_epsilon_high_is_a_cap_below_one():
    assert _trl_cispo_default_epsilon_high() == 0.2


@pytest.mark.parametrize("epsilon_high", ["trl-default", 0.2, 0.8, 5.0])
@settings(derandomize=True, deadline=None, max_examples=25)
@given(c=cases())
def test_cispo_mapping_matches_trl(trl_compute_loss, epsilon_high, c: Case):
    """TRL ``cispo`` with ``epsilon_high=e`` is ``LossConfig(policy="cispo", cispo_max=e)``, exactly,
    at TRL's default (0.2: every ratio above it is capped, a weight below 1) and at 0.2, 0.8, 5.0."""
    e = _trl_cispo_default_epsilon_high() if epsilon_high == "trl-default" else epsilon_high
    _check_cispo(trl_compute_loss, _wide(c), e)


@pytest.mark.parametrize("epsilon_high", [0.2, 0.8, 5.0])
def test_cispo_mapping_caps_both_sides(trl_compute_loss, epsilon_high):
    """One large fixed case where the cap is active on some tokens and not on others."""
    gen = torch.Generator().manual_seed(0)
    n, t = 16, 12
    logps = -2.5 + 2.45 * torch.rand(n, t, generator=gen, dtype=torch.float64)
    old = logps + 4.0 * (torch.rand(n, t, generator=gen, dtype=torch.float64) - 0.5)
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (n,), generator=gen)[:, None]).long()
    ratio = torch.exp(logps - old)[mask.bool()]
    assert bool((ratio > epsilon_high).any()) and bool((ratio < epsilon_high).any())
    z = torch.zeros(n, dtype=torch.float64)
    c = Case(logps, old, logps.clone(), old.clone(), torch.ones_like(logps), mask,
             torch.randn(n, generator=gen, dtype=torch.float64), z, z.long())  # fmt: skip
    _check_cispo(trl_compute_loss, c, epsilon_high)


def test_cispo_max_is_refused_where_unused():
    with pytest.raises(ValueError, match="cispo_max: only used with policy='cispo'"):
        LossConfig(cispo_max=0.2)
    with pytest.raises(ValueError, match="cispo_max: replaces the clip range"):
        LossConfig(policy="cispo", cispo_max=0.2, eps_high=0.28)
