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
    """How rewards become advantages: every field, its formula and the framework option it reproduces
    are in docs/core_maths.md ("Advantages")."""

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
    """Rollout correction: importance weights ``pi_train / pi_sampler`` (no gradient) multiplying the
    policy term per token; fields in docs/core_maths.md ("Rollout correction")."""

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
    """The policy objective, its KL and entropy terms, and how ``[N, T]`` is reduced to a scalar;
    every field and the framework option it reproduces: docs/core_maths.md ("The loss")."""

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
