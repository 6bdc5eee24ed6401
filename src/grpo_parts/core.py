"""GRPO maths shared by every part and adapter: group advantages, the clipped policy loss,
KL estimators and loss aggregation.

Conventions (shapes in names):

* ``rewards: [N]`` one scalar reward per completion; ``group_index: [N]`` the prompt (group) each
  completion belongs to. Groups need not be contiguous or equal-sized.
* ``logps, old_logps, ref_logps: [N, T]`` per-token log-probs of the completion tokens,
  ``mask: [N, T]`` 1 for tokens that count in the loss.

Everything here is differentiable where it should be (the loss w.r.t. ``logps``) and never
produces NaN for well-formed input: a zero-variance group gets advantage exactly 0.
The numerics follow verl 0.9.1 ``core_algos`` and TRL 1.16 ``GRPOTrainer._compute_loss``;
``tests/test_core_agreement.py`` checks both on random inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import GRPOPartsError, check_same_shape, check_tensor

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]


class AdvantageConfig(BaseModel):
    """How rewards become advantages.

    ``norm``: ``"group"`` divides by each group's std (GRPO), ``"batch"`` by the std of the whole
    batch's rewards (mean is still per group), ``"none"`` only subtracts the group mean (Dr. GRPO).
    ``unbiased_std``: torch's default (N-1) std as in verl and open-r1; ``False`` gives the biased std.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    norm: Literal["group", "batch", "none"] = "group"
    unbiased_std: bool = True
    eps: float = Field(1e-6, ge=0.0)


class LossConfig(BaseModel):
    """The clipped GRPO objective.

    ``eps_low``/``eps_high``: asymmetric clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO's clip-higher).
    ``dual_clip``: if set (> 1), for negative advantages the per-token loss is capped at
    ``-A * dual_clip`` (dual-clip PPO, verl's ``clip_ratio_c``).
    ``kl_coef``/``kl_estimator``: KL penalty to the reference policy added per token before aggregation.
    ``agg``: token-mean (DAPO), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr. GRPO,
    token sums divided by ``norm_constant``, default the padded completion length T).
    ``log_ratio_clamp``: clamp on ``logp - old_logp`` before ``exp`` (verl uses 20).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    eps_high: float = Field(0.2, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: KLEstimator = "k3"
    agg: AggMode = "token-mean"
    norm_constant: float | None = Field(None, gt=0.0)
    log_ratio_clamp: float | None = Field(20.0, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.norm_constant is not None and self.agg != "seq-mean-token-sum-norm":
            raise ValueError(
                f"norm_constant: only used with agg='seq-mean-token-sum-norm', got agg={self.agg!r}"
            )
        return self


# --------------------------------------------------------------------------------------- advantages


def _check_groups(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int | None) -> int:
    check_tensor("rewards", rewards, ndim=1, dtype="float")
    check_tensor("group_index", group_index, shape=[rewards.shape[0]], dtype="int")
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        row = int((~finite).nonzero()[0])
        raise GRPOPartsError(f"rewards: expected finite values, got {rewards[row].item()} at row {row}")
    lo, hi = int(group_index.min()), int(group_index.max())
    if lo < 0:
        raise GRPOPartsError(f"group_index: expected values >= 0, got {lo}")
    if num_groups is None:
        return hi + 1
    if hi >= num_groups:
        raise GRPOPartsError(f"group_index: expected values < num_groups={num_groups}, got {hi}")
    return num_groups


def group_stats(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int | None = None, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group ``(count, mean, std, zero_variance)``, each ``[num_groups]``.

    ``zero_variance`` is True where every reward in the group is equal (including singleton and
    empty groups); it is decided by exact comparison, not by a std threshold, so rounding in the
    mean can never turn an all-equal group into tiny nonzero advantages.
    """
    n_groups = _check_groups(rewards, group_index, num_groups)
    idx = group_index.long()
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, idx, torch.ones_like(rewards)
    )
    total = torch.zeros_like(count).index_add_(0, idx, rewards)
    mean = total / count.clamp(min=1)
    centered = rewards - mean[idx]  # two-pass variance: exact enough for float64 agreement tests
    sq = torch.zeros_like(count).index_add_(0, idx, centered * centered)
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    std = (sq / denom).sqrt()
    big = torch.finfo(rewards.dtype).max
    gmax = torch.full_like(count, -big).scatter_reduce_(0, idx, rewards, reduce="amax")
    gmin = torch.full_like(count, big).scatter_reduce_(0, idx, rewards, reduce="amin")
    zero_var = (gmax == gmin) | (count <= 1)
    return count, mean, std, zero_var


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    config: AdvantageConfig | None = None,
    num_groups: int | None = None,
) -> torch.Tensor:
    """``A_i = (r_i - mean_g) / (std + eps)``; returns ``advantages: [N]`` (no grad).

    Zero-variance groups (all rewards equal, or a single completion) get exactly 0.
    Note: verl gives a singleton group ``r / (1 + eps)``; we give 0 because a lone completion
    carries no relative signal (documented in docs/core_maths.md).
    """
    cfg = config or AdvantageConfig()
    with torch.no_grad():
        _, mean, std, zero_var = group_stats(rewards, group_index, num_groups, cfg.unbiased_std)
        idx = group_index.long()
        adv = rewards - mean[idx]
        if cfg.norm == "group":
            adv = adv / (std[idx] + cfg.eps)
        elif cfg.norm == "batch":
            bstd = rewards.std(unbiased=cfg.unbiased_std) if rewards.numel() > 1 else rewards.new_zeros(())
            adv = adv / (bstd + cfg.eps)
        adv = torch.where(zero_var[idx], torch.zeros_like(adv), adv)
    return adv


# --------------------------------------------------------------------------------------- KL, loss


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = log pi - log pi_ref; k2 = 0.5 (log pi - log pi_ref)^2; k3 = exp(d) - d - 1 with
    d = log pi_ref - log pi (clamped to [-20, 20], result clamped to [-10, 10] as verl does).
    """
    check_same_shape(["logps", "ref_logps"], [logps, ref_logps])
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k2":
        return 0.5 * (logps - ref_logps).square()
    if estimator == "k3":
        d = torch.clamp(ref_logps - logps, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    raise GRPOPartsError(f"kl_estimator: expected one of 'k1', 'k2', 'k3', got {estimator!r}")


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode,
    *,
    norm_constant: float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat: [N, T]`` under ``mask: [N, T]`` to a scalar.

    ``num_tokens`` / ``num_seqs`` override the denominators (token-mean / seq-mean) so that a batch
    split into micro-batches, or pruned by a filter, is normalised by the global count (TRL's
    ``num_items_in_batch``, verl's ``batch_num_tokens``/``global_batch_size``). Fully masked rows
    do not count as sequences. An all-masked batch gives 0, not NaN.
    """
    check_tensor("loss_mat", loss_mat, ndim=2, dtype="float", allow_empty=True)
    check_tensor("mask", mask, allow_empty=True)
    check_same_shape(["loss_mat", "mask"], [loss_mat, mask])
    m = mask.to(loss_mat.dtype)
    loss_mat = torch.where(m > 0, loss_mat, torch.zeros_like(loss_mat))  # NaN/inf at padding must not leak
    if mode == "token-mean":
        denom = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=loss_mat.dtype)
        return (loss_mat * m).sum() / denom.clamp(min=1.0)
    tok = m.sum(-1)
    seq_mask = (tok > 0).to(loss_mat.dtype)
    n_seq = seq_mask.sum() if num_seqs is None else torch.as_tensor(num_seqs, dtype=loss_mat.dtype)
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * m).sum(-1) / tok.clamp(min=1.0)
        return (seq * seq_mask).sum() / n_seq.clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        seq = (loss_mat * m).sum(-1)
        c = float(loss_mat.shape[-1]) if norm_constant is None else norm_constant
        return (seq * seq_mask).sum() / n_seq.clamp(min=1.0) / c
    raise GRPOPartsError(
        f"agg: expected one of 'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum-norm', got {mode!r}"
    )


@dataclass(frozen=True)
class LossOutput:
    """``loss`` is the scalar to backprop; the rest are detached diagnostics."""

    loss: torch.Tensor
    per_token_loss: torch.Tensor  # [N, T] before aggregation (policy term + kl_coef * kl), 0 where masked
    clip_fraction: float
    kl: float  # masked mean of the KL estimate (0.0 when kl_coef == 0 and no ref given)
    ratio_mean: float


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> LossOutput:
    """Clipped GRPO loss. ``advantages`` is ``[N]`` (one per completion) or ``[N, T]``.

    Per token: ``-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`` with
    ``rho = exp(logp - old_logp)``; dual-clip caps it at ``-A * c`` for ``A < 0``; plus
    ``kl_coef * KL_est(logp, ref_logp)``; then :func:`aggregate`.
    """
    cfg = config or LossConfig()
    check_tensor("logps", logps, ndim=2, dtype="float")
    check_tensor("old_logps", old_logps, dtype="float", allow_empty=True)
    check_tensor("mask", mask, allow_empty=True)
    check_same_shape(["logps", "old_logps", "mask"], [logps, old_logps, mask])
    check_tensor("advantages", advantages, dtype="float", allow_empty=True)
    if not bool(torch.isfinite(advantages).all()):
        raise GRPOPartsError("advantages: expected finite values, got NaN or inf")
    if ref_logps is not None:
        check_tensor("ref_logps", ref_logps, dtype="float", allow_empty=True)
    if advantages.ndim == 1:
        check_tensor("advantages", advantages, shape=[logps.shape[0]], dtype="float")
        adv = advantages.unsqueeze(-1)
    else:
        check_tensor("advantages", advantages, shape=list(logps.shape), dtype="float")
        adv = advantages
    # Padding positions may hold anything (-inf, NaN): zero them first so that neither the loss,
    # the diagnostics nor the gradient can see them (torch.where passes no gradient to them).
    keep = mask != 0
    logps, old_logps = torch.where(keep, logps, 0.0), torch.where(keep, old_logps, 0.0)
    if ref_logps is not None and ref_logps.shape == logps.shape:
        ref_logps = torch.where(keep, ref_logps, 0.0)
    if adv.shape == logps.shape:
        adv = torch.where(keep, adv, 0.0)
    log_ratio = logps - old_logps
    if cfg.log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = torch.maximum(loss1, loss2)
    if cfg.dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * cfg.dual_clip), per_token)
    m = mask.to(logps.dtype)
    kl_val = 0.0
    if cfg.kl_coef > 0.0:
        if ref_logps is None:
            raise GRPOPartsError("ref_logps: expected a [N, T] tensor because kl_coef > 0, got None")
        kl = kl_estimate(logps, ref_logps, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        kl_val = float((kl.detach() * m).sum() / m.sum().clamp(min=1.0))
    loss = aggregate(
        per_token, mask, cfg.agg, norm_constant=cfg.norm_constant, num_tokens=num_tokens, num_seqs=num_seqs
    )
    with torch.no_grad():
        denom = m.sum().clamp(min=1.0)
        clip_frac = float(((loss2 > loss1).to(m.dtype) * m).sum() / denom)
        ratio_mean = float((ratio * m).sum() / denom)
    return LossOutput(loss, per_token.detach().masked_fill(~keep, 0.0), clip_frac, kl_val, ratio_mean)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``tokens``: ``[..., V] x [...] -> [...]``.

    This is *the* definition of a per-token log-prob in grpo_parts (as in TRL and verl): temperature
    applied, top-p / top-k not applied. Samplers return it, attention backends compute it.
    """
    if temperature <= 0:
        raise GRPOPartsError(f"temperature: expected > 0 for log-probs, got {temperature}")
    check_tensor("tokens", tokens, shape=list(logits.shape[:-1]), dtype="int", allow_empty=True)
    lg = logits if temperature == 1.0 else logits / temperature
    return (
        torch.log_softmax(lg.float() if lg.dtype in (torch.float16, torch.bfloat16) else lg, dim=-1)
        .gather(-1, tokens.unsqueeze(-1))
        .squeeze(-1)
    )
