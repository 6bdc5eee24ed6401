"""Rewards -> advantages: GRPO (Dr. GRPO), RLOO, REINFORCE++-baseline, reward clipping, KL in the reward.

Every estimator gives a zero-variance group (all rewards equal, at least two) a centred value of
exactly 0, decided by exact comparison, so rounding in the mean never leaks tiny advantages.
"""

from __future__ import annotations

import torch

from ..errors import GRPOPartsError, check_tensor
from .config import AdvantageConfig
from .kl import kl_estimate

_NO_KL_LOGPS = "ref_logps: expected [N, T] old and reference log-probs because kl_coef > 0, got None"


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
    """Per-group ``(count, mean, std, zero_variance)``, each ``[num_groups]``; ``zero_variance``: every
    reward equal (singleton and empty groups too), by exact comparison (module docstring)."""
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


def _shaped(
    rewards: torch.Tensor, group_index: torch.Tensor, cfg: AdvantageConfig, n_groups: int
) -> torch.Tensor:
    """The estimator's per-completion value, then OpenRLHF's clip of the shaped reward (before
    per-token KL and whitening)."""
    count, mean, std, zero_var = group_stats(rewards, group_index, n_groups, cfg.unbiased_std)
    idx = group_index.long()
    lone = (count <= 1)[idx]
    # a lone completion: baseline 0 and scale 1 under singleton="reward" (verl), else advantage 0
    adv = torch.where(lone, rewards, rewards - mean[idx])
    if cfg.estimator == "rloo":
        # r_i - mean of the others = n / (n - 1) * (r_i - mean); verl and OpenRLHF, same value
        n = count[idx]
        adv = torch.where(lone, adv, adv * n / (n - 1).clamp(min=1))
    elif cfg.estimator == "grpo" and cfg.norm == "group":
        scale = torch.where(lone, torch.ones_like(rewards), std[idx])
        adv = adv / (scale + cfg.eps)
    elif cfg.estimator == "grpo" and cfg.norm == "batch":
        bstd = rewards.std(unbiased=cfg.unbiased_std) if rewards.numel() > 1 else rewards.new_zeros(())
        adv = adv / (bstd + cfg.eps)
    zero = zero_var[idx] & ~lone if cfg.singleton == "reward" else zero_var[idx]
    adv = torch.where(zero, torch.zeros_like(adv), adv)
    if cfg.reward_clip is not None:
        adv = adv.clamp(cfg.reward_clip[0], cfg.reward_clip[1])
    return adv


def _whiten(values: torch.Tensor, weights: torch.Tensor, style: str) -> torch.Tensor:
    """Whiten over tokens: ``values`` ``[N]`` with token counts ``weights [N]``, or ``[N, T]`` with a mask.
    verl ``masked_whiten``: mean and variance divide by ``count + 1e-8``, the variance is unbiased,
    ``rsqrt(var + 1e-8)``. OpenRLHF: exact count, biased variance, ``rsqrt(max(var, 1e-8))``."""
    w = weights.to(values.dtype)
    n = w.sum()
    if float(n) == 0.0:
        return torch.zeros_like(values)
    denom = n + 1e-8 if style == "verl" else n
    mean = (values * w).sum() / denom
    var = ((values - mean).square() * w).sum() / denom
    if style == "verl":
        var = var * n / (n - 1).clamp(min=1.0)  # Bessel over tokens (verl raises on a single token)
        return (values - mean) * torch.rsqrt(var + 1e-8)
    return (values - mean) * torch.rsqrt(var.clamp(min=1e-8))


def kl_reward_penalty(
    old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, config: AdvantageConfig
) -> torch.Tensor:
    """``[N, T]``: ``kl_coef * KL_t`` of the rollout-time policy to the reference, 0 where masked."""
    check_tensor("mask", mask, ndim=2, allow_empty=True)
    m = mask.to(old_logps.dtype)
    keep = m > 0
    old, ref = torch.where(keep, old_logps, 0.0), torch.where(keep, ref_logps, 0.0)
    return config.kl_coef * kl_estimate(old, ref, config.kl_estimator, config.kl_clamp) * m


def kl_shaped_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    config: AdvantageConfig,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
) -> torch.Tensor:
    """``rewards - kl_coef * sum_t KL_t``: the reward the estimator sees under ``kl_placement="sequence"``
    (verl ``apply_kl_penalty``; ``rewards`` itself when ``kl_coef == 0``)."""
    if config.kl_coef == 0.0:
        return rewards
    if config.kl_placement != "sequence":
        raise GRPOPartsError(
            "kl_placement: 'token' gives per-token advantages; use compute_advantages, got a per-completion path"
        )
    if old_logps is None or ref_logps is None:
        raise GRPOPartsError(_NO_KL_LOGPS)
    with torch.no_grad():
        return rewards - kl_reward_penalty(old_logps, ref_logps, mask, config).sum(-1).to(rewards.dtype)


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    config: AdvantageConfig | None = None,
    num_groups: int | None = None,
    *,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """``advantages: [N]`` (no grad) for one scalar reward per completion. ``lengths: [N]`` (completion
    token counts) is needed by ``reinforce_plus_plus_baseline``, which whitens over tokens. The
    KL-in-reward fields are not used here: :func:`compute_advantages` applies them (for ``"sequence"`` it
    calls this on :func:`kl_shaped_rewards`)."""
    cfg = config or AdvantageConfig()
    n_groups = _check_groups(rewards, group_index, num_groups)
    with torch.no_grad():
        adv = _shaped(rewards, group_index, cfg, n_groups)
        if cfg.estimator == "reinforce_plus_plus_baseline":
            if lengths is None:
                raise GRPOPartsError(
                    "lengths: expected [N] completion lengths for estimator='reinforce_plus_plus_baseline', got None"
                )
            check_tensor("lengths", lengths, shape=[rewards.shape[0]])
            adv = _whiten(adv, lengths, cfg.whiten)
    return adv


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    config: AdvantageConfig | None = None,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    num_groups: int | None = None,
) -> torch.Tensor:
    """The full path, KL in the reward included: ``[N]``, or ``[N, T]`` for ``kl_placement="token"``. Order
    (each framework's): KL ``"sequence"`` penalty into the reward -> estimator -> reward clip -> KL
    ``"token"`` returns-to-go -> whitening (REINFORCE++-baseline). ``old_logps`` are the rollout-time
    policy's log-probs (verl ``old_log_probs``, OpenRLHF ``action_log_probs``)."""
    cfg = config or AdvantageConfig()
    check_tensor("mask", mask, shape=[rewards.shape[0], None], allow_empty=True)
    lengths = mask.sum(-1)
    if cfg.kl_coef == 0.0:
        return group_advantages(rewards, group_index, cfg, num_groups, lengths=lengths)
    if old_logps is None or ref_logps is None:
        raise GRPOPartsError(_NO_KL_LOGPS)
    n_groups = _check_groups(rewards, group_index, num_groups)
    with torch.no_grad():
        pen = kl_reward_penalty(old_logps, ref_logps, mask, cfg)
        if cfg.kl_placement == "sequence":
            return group_advantages(rewards - pen.sum(-1), group_index, cfg, n_groups, lengths=lengths)
        m = mask.to(pen.dtype)
        # returns-to-go (gamma = 1) of the per-token rewards -kl_coef * KL_t, plus the outcome
        to_go = pen.flip(-1).cumsum(-1).flip(-1)
        adv = (_shaped(rewards, group_index, cfg, n_groups)[:, None] - to_go) * m
        if cfg.estimator == "reinforce_plus_plus_baseline":
            adv = _whiten(adv, m, cfg.whiten) * m
    return adv
