"""The loss: policy term x rollout-correction weights, + KL, - entropy bonus, then aggregation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import GRPOPartsError, check_same_shape, check_tensor
from .config import AggMode, LossConfig
from .correction import correction_weights
from .kl import kl_estimate
from .policy import policy_terms
from .unbiased import loss_facts, refusal_reasons


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode,
    *,
    norm_constant: float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    count_empty: bool = False,
    seq_len_eps: float = 0.0,
    seq_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat: [N, T]`` under ``mask: [N, T]`` to a scalar. ``num_tokens`` / ``num_seqs``
    override the denominators, so that a batch split into micro-batches or pruned is normalised by the
    global count (TRL's ``num_items_in_batch``); fully masked rows count as sequences only under
    ``count_empty``; an all-masked batch gives 0, not NaN. ``seq_weights: [N]`` multiplies each row's
    contribution and leaves the denominators alone (pass the full batch's). Formulas: docs/core_maths.md,
    "Aggregation"."""
    check_tensor("loss_mat", loss_mat, ndim=2, dtype="float", allow_empty=True)
    check_tensor("mask", mask, allow_empty=True)
    check_same_shape(["loss_mat", "mask"], [loss_mat, mask])
    m = mask.to(loss_mat.dtype)
    loss_mat = torch.where(m > 0, loss_mat, torch.zeros_like(loss_mat))  # NaN/inf at padding must not leak
    if seq_weights is not None:
        check_tensor("seq_weights", seq_weights, shape=[loss_mat.shape[0]], dtype="float", allow_empty=True)
        loss_mat = loss_mat * seq_weights.to(loss_mat.dtype)[:, None]
    if mode == "token-mean":
        denom = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=loss_mat.dtype)
        return (loss_mat * m).sum() / denom.clamp(min=1.0)
    tok = m.sum(-1)
    seq_mask = torch.ones_like(tok) if count_empty else (tok > 0).to(loss_mat.dtype)
    n_seq = seq_mask.sum() if num_seqs is None else torch.as_tensor(num_seqs, dtype=loss_mat.dtype)
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * m).sum(-1) / (tok + seq_len_eps if seq_len_eps > 0 else tok.clamp(min=1.0))
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
    per_token_loss: torch.Tensor  # [N, T] policy term (x correction weights) + per-token KL, 0 where masked
    clip_fraction: float
    ratio_mean: float
    kl: float = 0.0  # masked mean of the KL estimate (0.0 when kl_coef == 0)
    entropy: float = 0.0  # masked mean of the entropy (0.0 when entropy_coef == 0)
    correction_mean: float = 1.0  # masked mean of the rollout-correction weights (1.0 when off)


def _check_inputs(logps, old_logps, advantages, mask, ref_logps, entropy, rollout_logps) -> torch.Tensor:
    """Validate; return the advantages as ``[N, 1]`` or ``[N, T]``."""
    check_tensor("logps", logps, ndim=2, dtype="float")
    check_tensor("old_logps", old_logps, dtype="float", allow_empty=True)
    check_tensor("mask", mask, allow_empty=True)
    check_same_shape(["logps", "old_logps", "mask"], [logps, old_logps, mask])
    check_tensor("advantages", advantages, dtype="float", allow_empty=True)
    if not bool(torch.isfinite(advantages).all()):
        raise GRPOPartsError("advantages: expected finite values, got NaN or inf")
    for name, t in (("ref_logps", ref_logps), ("entropy", entropy), ("rollout_logps", rollout_logps)):
        if t is not None:
            check_tensor(name, t, shape=list(logps.shape), dtype="float", allow_empty=True)
    if advantages.ndim == 1:
        check_tensor("advantages", advantages, shape=[logps.shape[0]], dtype="float")
        return advantages.unsqueeze(-1)
    check_tensor("advantages", advantages, shape=list(logps.shape), dtype="float")
    return advantages


def _require(name: str, t: torch.Tensor | None, why: str) -> torch.Tensor:
    if t is None:
        raise GRPOPartsError(f"{name}: expected a [N, T] tensor because {why}, got None")
    return t


def _masked_mean(t: torch.Tensor, m: torch.Tensor) -> float:
    return float((t.detach().to(m.dtype).expand_as(m) * m).sum() / m.sum().clamp(min=1.0))


def _check_seq_weights(
    w: torch.Tensor | None, n: int, cfg: LossConfig, num_tokens: float | None, num_seqs: float | None
) -> None:
    """``seq_weights`` need fixed denominators: every aggregation the loss runs must get the full
    batch's count, not the kept rows' own (which depends on which rows were kept: biased)."""
    if w is None:
        return
    check_tensor("seq_weights", w, shape=[n], dtype="float", allow_empty=True)
    if w.numel() and not bool((torch.isfinite(w) & (w >= 0)).all()):
        raise GRPOPartsError("seq_weights: expected finite values >= 0, got one that is not")
    facts = loss_facts(cfg, "seq_weights")
    reasons = refusal_reasons(facts)
    if reasons:
        raise GRPOPartsError(f"seq_weights: {reasons[0]}")
    why = "the kept rows' own count depends on which rows were kept, which biases the weighted loss"
    if facts.token_normalised and num_tokens is None:
        name = facts.token_normalised[0][0]
        raise GRPOPartsError(f"seq_weights: {name} needs num_tokens= (the full batch's token count); {why}")
    if cfg.agg != "token-mean" and num_seqs is None:
        raise GRPOPartsError(
            f"seq_weights: agg={cfg.agg!r} needs num_seqs= (the full batch's sequence count); {why}"
        )


def _aggregate_terms(
    per_token: torch.Tensor,
    kl: torch.Tensor | None,
    ent: torch.Tensor | None,
    mask: torch.Tensor,
    cfg: LossConfig,
    agg_kw: dict,
) -> torch.Tensor:
    """``per_token`` aggregated by ``cfg.agg``, plus a KL kept apart (``kl_agg="token-mean"``), minus
    the entropy bonus (aggregated like the loss, or as a token mean)."""
    loss = aggregate(per_token, mask, cfg.agg, **agg_kw)
    if kl is not None:  # OpenRLHF: its own token mean, whatever the policy term's aggregation
        kl_kw = {k: agg_kw[k] for k in ("num_tokens", "seq_weights")}
        loss = loss + cfg.kl_coef * aggregate(kl, mask, "token-mean", **kl_kw)
    if ent is not None:
        mode = cfg.agg if cfg.entropy_agg == "loss" else "token-mean"
        loss = loss - cfg.entropy_coef * aggregate(ent, mask, mode, **agg_kw)
    return loss


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    entropy: torch.Tensor | None = None,
    rollout_logps: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    seq_weights: torch.Tensor | None = None,
) -> LossOutput:
    """The GRPO-family loss. ``advantages`` is ``[N]`` (one per completion) or ``[N, T]``. Per token: the
    ``config.policy`` term times the rollout-correction weight (``rollout_logps``), plus the KL to
    ``ref_logps``; aggregated by ``config.agg``; minus the entropy bonus (``entropy`` from the same forward
    as ``logps``): docs/core_maths.md, "The loss". ``seq_weights: [N]`` multiply every term of their row
    and need the full batch's ``num_tokens`` / ``num_seqs`` (:mod:`.unbiased`)."""
    cfg = config or LossConfig()
    adv = _check_inputs(logps, old_logps, advantages, mask, ref_logps, entropy, rollout_logps)
    _check_seq_weights(seq_weights, logps.shape[0], cfg, num_tokens, num_seqs)
    # Padding positions may hold anything (-inf, NaN): zero them first so that neither the loss,
    # the diagnostics nor the gradient can see them (torch.where passes no gradient to them).
    keep = mask != 0
    m = mask.to(logps.dtype)

    def clean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t, 0.0)

    logps, old_logps = clean(logps), clean(old_logps)
    per_token, ratio, clipped = policy_terms(
        logps, old_logps, clean(adv) if adv.shape == m.shape else adv, m, cfg
    )
    out = {"clip_fraction": _masked_mean(clipped, m), "ratio_mean": _masked_mean(ratio, m)}
    if cfg.correction.level != "off":
        rollout = clean(_require("rollout_logps", rollout_logps, "correction.level != 'off'"))
        weights = correction_weights(old_logps, rollout, mask, cfg.correction)
        assert weights is not None
        per_token, out["correction_mean"] = per_token * weights, _masked_mean(weights, m)
    agg_kw: dict = dict(norm_constant=cfg.norm_constant, num_tokens=num_tokens, num_seqs=num_seqs)
    agg_kw.update(count_empty=cfg.seq_count == "all", seq_len_eps=cfg.seq_len_eps, seq_weights=seq_weights)
    kl: torch.Tensor | None = None
    if cfg.kl_coef > 0.0:
        ref = clean(_require("ref_logps", ref_logps, "kl_coef > 0"))
        kl = kl_estimate(logps, ref, cfg.kl_estimator, cfg.kl_clamp)
        out["kl"] = _masked_mean(kl, m)
        if cfg.kl_ratio_weight:  # TRL: the unbiased reverse-KL gradient off-policy
            kl = kl * ratio
        if cfg.kl_agg == "loss":  # verl, TRL: per token, aggregated with the policy term
            per_token, kl = per_token + cfg.kl_coef * kl, None
    ent: torch.Tensor | None = None
    if cfg.entropy_coef > 0.0:
        ent = clean(_require("entropy", entropy, "entropy_coef > 0"))
        out["entropy"] = _masked_mean(ent, m)
    loss = _aggregate_terms(per_token, kl, ent, mask, cfg, agg_kw)
    return LossOutput(loss, per_token.detach().masked_fill(~keep, 0.0), **out)
