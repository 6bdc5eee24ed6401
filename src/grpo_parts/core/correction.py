"""Rollout correction: importance weights for the sampler/trainer log-prob mismatch.

The sampler (vLLM, a speculative sampler, a bf16 engine) and the trainer compute slightly different
log-probs for the same tokens, so the rollout is slightly off-policy even before any update. The
weight ``w = pi_train_old / pi_sampler`` (per token, or per completion) multiplies the policy term of
the loss; truncation (TIS) bounds its variance, masking (IcePop / masked IS) drops units whose
mismatch is too large. verl ``rollout_corr_helper``, TRL ``vllm_importance_sampling_mode`` and
OpenRLHF ``is_correction_*`` are each one setting of :class:`CorrectionConfig`.
"""

from __future__ import annotations

import torch

from ..errors import check_same_shape
from .config import CorrectionConfig


def correction_weights(
    old_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, config: CorrectionConfig
) -> torch.Tensor | None:
    """``[N, T]`` weights (no grad, 0 where masked), or None when ``config.level == "off"``. ``old_logps``
    are the trainer's log-probs under the policy that sampled (recomputed), and ``rollout_logps`` the
    sampler's own for the same tokens. NaN sampler log-probs (unavailable from the engine) count as no
    mismatch, as TRL does."""
    if config.level == "off":
        return None
    check_same_shape(["old_logps", "rollout_logps", "mask"], [old_logps, rollout_logps, mask])
    m = mask.to(old_logps.dtype)
    with torch.no_grad():
        token_lr = torch.nan_to_num((old_logps - rollout_logps) * m, nan=0.0)
        if config.level == "token":
            unit_lr = token_lr
        elif config.seq_log_ratio == "sum":
            unit_lr = token_lr.sum(-1, keepdim=True)
        else:
            unit_lr = token_lr.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        if config.log_ratio_clamp is not None:
            unit_lr = unit_lr.clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
        ratio = torch.exp(unit_lr)
        if config.mode == "truncate":
            w = ratio.clamp(min=config.low, max=config.high)
        else:
            keep = ratio.clamp(min=config.low, max=config.high) == ratio  # inside [low, high]
            carried = ratio if config.mask_weight == "unit" else torch.exp(token_lr)
            w = torch.where(keep, carried, torch.zeros_like(carried))
        return w.expand_as(m) * m
