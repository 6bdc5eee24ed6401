"""Typed configs of the GRPO maths: one frozen pydantic model per concern, extra fields refused.

Every framework option that :mod:`grpo_parts.core` reproduces maps to one field value here;
docs/core_maths.md has the table (framework option -> field) and the cases that differ on purpose.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
#: which KL estimates are clamped: "k3" = verl (k3's d to [-20, 20] and value to [-10, 10], k1/k2 raw),
#: "all" = OpenRLHF (every estimator's value to [-10, 10]), "none" = TRL (no clamp at all)
KLClamp = Literal["k3", "all", "none"]
Estimator = Literal["grpo", "rloo", "reinforce_plus_plus_baseline"]
PolicyLoss = Literal["clip", "gspo", "gspo_token", "cispo", "sapo"]


class AdvantageConfig(BaseModel):
    """How rewards become advantages (see docs/core_maths.md for every formula).

    ``estimator``: ``"grpo"`` (group-normalised; ``norm`` picks the scale), ``"rloo"`` (leave-one-out
    mean baseline, scaled by ``n / (n - 1)``), ``"reinforce_plus_plus_baseline"`` (group mean baseline,
    then the whole batch whitened over its tokens; ``whiten`` picks verl's or OpenRLHF's formula).
    ``norm`` (grpo only): ``"group"`` divides by each group's std, ``"batch"`` by the std of the
    whole batch's rewards, ``"none"`` only subtracts the group mean (Dr. GRPO).
    ``unbiased_std``: (N-1) std as in verl and open-r1; ``False`` gives the biased std.
    ``singleton``: a group of one gets ``"zero"`` advantage (no relative signal), or ``"reward"``:
    baseline 0 and scale 1, as verl does.
    ``reward_clip``: ``(low, high)`` clamp on each completion's shaped reward (after the group
    baseline, before per-token KL and whitening), as OpenRLHF's ``reward.clip_range``.
    ``kl_coef > 0`` puts a KL penalty to the reference policy into the reward (computed from the
    rollout-time policy's log-probs): ``kl_placement="sequence"`` subtracts ``kl_coef * sum_t KL_t``
    from each reward before the estimator (verl ``use_kl_in_reward``); ``"token"`` adds
    ``-kl_coef * KL_t`` as per-token rewards after the baseline, advantages are returns-to-go
    ``[N, T]`` (OpenRLHF ``init_kl_coef`` with ``kl.use_loss=False``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    estimator: Estimator = "grpo"
    norm: Literal["group", "batch", "none"] = "group"
    unbiased_std: bool = True
    eps: float = Field(1e-6, ge=0.0)
    whiten: Literal["verl", "openrlhf"] = "verl"
    singleton: Literal["zero", "reward"] = "zero"
    reward_clip: tuple[float, float] | None = None
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: KLEstimator = "k1"
    kl_clamp: KLClamp = "k3"
    kl_placement: Literal["sequence", "token"] = "sequence"

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        if self.norm != "group" and self.estimator != "grpo":
            raise ValueError(f"norm: only used with estimator='grpo', got estimator={self.estimator!r}")
        if self.reward_clip is not None and self.reward_clip[0] > self.reward_clip[1]:
            raise ValueError(f"reward_clip: expected (low, high) with low <= high, got {self.reward_clip}")
        return self


class CorrectionConfig(BaseModel):
    """Rollout correction: importance weights ``pi_train / pi_sampler`` for the mismatch between the
    trainer's old-policy log-probs and the sampler's, multiplying the policy term per token.

    ``level``: ``"off"``, ``"token"`` (one ratio per token) or ``"sequence"`` (one per completion:
    ``exp`` of the ``seq_log_ratio`` of its token log-ratios, ``"sum"`` = product of token ratios as
    verl and TRL, ``"mean"`` = geometric mean as OpenRLHF). ``mode``: ``"truncate"`` clamps the ratio
    to ``[low, high]`` (TIS; a None bound is open), ``"mask"`` zeroes it outside ``[low, high]``
    (IcePop / masked IS). ``mask_weight``: what a surviving unit carries in mask mode, its own ratio
    (``"unit"``: verl, TRL) or each token's ratio (``"token"``: OpenRLHF's sequence-level mask).
    ``log_ratio_clamp``: clamp on the log-ratio before ``exp`` (verl's safety bound 20; None as TRL
    and OpenRLHF). Weights carry no gradient.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: Literal["off", "token", "sequence"] = "off"
    mode: Literal["truncate", "mask"] = "truncate"
    low: float | None = Field(None, ge=0.0)
    high: float | None = Field(2.0, gt=0.0)
    seq_log_ratio: Literal["sum", "mean"] = "sum"
    mask_weight: Literal["unit", "token"] = "unit"
    log_ratio_clamp: float | None = Field(20.0, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> CorrectionConfig:
        if self.low is None and self.high is None:
            raise ValueError("high: expected at least one of low/high to be set, got both None")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low: expected <= high={self.high}, got {self.low}")
        return self


class LossConfig(BaseModel):
    """The policy objective, its KL and entropy terms, and how ``[N, T]`` is reduced to a scalar.

    ``policy``: ``"clip"`` (PPO-clip on token ratios: GRPO, DAPO), ``"gspo"`` (clip on the
    sequence ratio ``exp(mean_t log rho_t)``, its gradient through the mean: TRL, OpenRLHF),
    ``"gspo_token"`` (GSPO-token: the same value, each token's gradient scaled by the detached
    sequence ratio: verl ``gspo``), ``"cispo"`` (``-sg(clip(rho)) * A * logp``), ``"sapo"``
    (``-gate(rho) * A``, soft gate with ``sapo_tau_pos`` / ``sapo_tau_neg``).
    ``eps_low``/``eps_high``: clip range ``[1 - eps_low, 1 + eps_high]`` (CISPO clips its weight to
    it, as verl; ``eps_low=1`` leaves it open below).
    ``cispo_max``: CISPO only: cap the weight at this value instead, ``sg(min(rho, cispo_max))``, no lower
    bound -- TRL's ``cispo`` with ``epsilon_high=e`` (unset: ``epsilon``, 0.2) is ``cispo_max=e``, which
    may be below 1 (``1 + eps_high`` cannot be); ``eps_low``/``eps_high`` then stay at their defaults.
    ``dual_clip``: if set (> 1), for negative advantages the per-token loss is capped at
    ``-A * dual_clip`` (verl ``clip_ratio_c``, OpenRLHF ``dual_clip``); clip and GSPO only.
    ``log_ratio_clamp``: clamp on ``logp - old_logp`` before ``exp`` (verl 20); for GSPO it clamps the
    sequence log-ratio from above only (verl uses 10).
    ``kl_coef``/``kl_estimator``/``kl_clamp``: KL penalty to the reference policy; ``kl_agg="loss"``
    adds it per token before aggregation (verl, TRL), ``"token-mean"`` aggregates it on its own
    (OpenRLHF); ``kl_ratio_weight`` multiplies it by the policy ratio (TRL ``use_bias_correction_kl``).
    ``entropy_coef``: entropy bonus ``- coef * H``, ``H`` aggregated like the loss (``"loss"``:
    verl) or as a token mean (TRL, OpenRLHF).
    ``agg``: token-mean (DAPO), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr.
    GRPO: token sums divided by ``norm_constant``, default the padded length T). ``seq_count``:
    whether fully masked rows count as sequences (``"all"``: TRL ``grpo``/``dr_grpo``).
    ``seq_len_eps``: added to each row's token count in seq-mean-token-mean (verl, OpenRLHF: 1e-8).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PolicyLoss = "clip"
    eps_low: float = Field(0.2, ge=0.0, le=1.0)
    eps_high: float = Field(0.2, ge=0.0)
    cispo_max: float | None = Field(None, gt=0.0)
    dual_clip: float | None = Field(None, gt=1.0)
    sapo_tau_pos: float = Field(1.0, gt=0.0)
    sapo_tau_neg: float = Field(1.05, gt=0.0)
    log_ratio_clamp: float | None = Field(20.0, gt=0.0)
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: KLEstimator = "k3"
    kl_clamp: KLClamp = "k3"
    kl_agg: Literal["loss", "token-mean"] = "loss"
    kl_ratio_weight: bool = False
    entropy_coef: float = Field(0.0, ge=0.0)
    entropy_agg: Literal["loss", "token-mean"] = "loss"
    agg: AggMode = "token-mean"
    norm_constant: float | None = Field(None, gt=0.0)
    seq_count: Literal["nonempty", "all"] = "nonempty"
    seq_len_eps: float = Field(0.0, ge=0.0)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.norm_constant is not None and self.agg != "seq-mean-token-sum-norm":
            raise ValueError(
                f"norm_constant: only used with agg='seq-mean-token-sum-norm', got agg={self.agg!r}"
            )
        if self.dual_clip is not None and self.policy not in ("clip", "gspo", "gspo_token"):
            raise ValueError(
                f"dual_clip: only used with policy 'clip', 'gspo', 'gspo_token', got {self.policy!r}"
            )
        if self.cispo_max is not None:
            if self.policy != "cispo":
                raise ValueError(f"cispo_max: only used with policy='cispo', got policy={self.policy!r}")
            fields = LossConfig.model_fields
            if (self.eps_low, self.eps_high) != (fields["eps_low"].default, fields["eps_high"].default):
                raise ValueError(
                    f"cispo_max: replaces the clip range, got it with eps_low={self.eps_low}, "
                    f"eps_high={self.eps_high}; expected those at their defaults"
                )
        if self.seq_len_eps and self.agg != "seq-mean-token-mean":
            raise ValueError(f"seq_len_eps: only used with agg='seq-mean-token-mean', got agg={self.agg!r}")
        if self.seq_count != "nonempty" and self.agg == "token-mean":
            raise ValueError("seq_count: only used with the seq-mean aggregations, got agg='token-mean'")
        return self
