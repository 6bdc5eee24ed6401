"""Per-token policy terms: PPO-clip, GSPO (sequence and token forms), CISPO, SAPO.

Each returns ``(per_token [N, T], ratio, clipped [N, T] bool)``: the loss before weights, KL and
aggregation; the importance ratio it used (``[N, T]``, or ``[N, 1]`` for GSPO's sequence ratio), and
where a clip or cap was the active branch (for the diagnostics).
"""

from __future__ import annotations

import torch

from .config import LossConfig

Terms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _token_ratio(log_ratio: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    if cfg.log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    return torch.exp(log_ratio)


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> Terms:
    """``max(-A rho, -A clip(rho))``, dual-clip capped at ``-A c`` for ``A < 0``."""
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    if cfg.dual_clip is not None:
        cap = -adv * cfg.dual_clip
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
        clipped = clipped | ((adv < 0) & (per_token == cap))
    return per_token, ratio, clipped


def policy_terms(
    logps: torch.Tensor, old_logps: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, cfg: LossConfig
) -> Terms:
    """Inputs already zeroed where masked; ``adv`` is ``[N, 1]`` or ``[N, T]``; ``m`` the float mask."""
    log_ratio = logps - old_logps
    if cfg.policy == "clip":
        return _clipped_objective(_token_ratio(log_ratio, cfg), adv, cfg)
    if cfg.policy in ("gspo", "gspo_token"):
        # gspo: s_i = exp(mean_t log rho_t), its gradient reaching each token through the mean (TRL,
        # OpenRLHF); gspo_token: value sg[s_i] per token, gradient sg[s_i] * grad logp_t (verl's ``gspo``)
        token = cfg.policy == "gspo_token"
        lr = log_ratio.detach() if token else log_ratio
        seq = (lr * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        if token:
            seq = logps - logps.detach() + seq
        if cfg.log_ratio_clamp is not None:  # from above only (verl's GSPO clamp is ``max=10``)
            seq = torch.clamp(seq, max=cfg.log_ratio_clamp)
        per_token, ratio, clipped = _clipped_objective(torch.exp(seq), adv, cfg)
        return per_token.expand_as(m), ratio, clipped.expand_as(m)
    ratio = _token_ratio(log_ratio, cfg)
    if cfg.policy == "cispo":
        # the clipped ratio is a detached weight on the REINFORCE term: clipped tokens keep a gradient
        if cfg.cispo_max is not None:  # TRL: an absolute cap (may be below 1), nothing below
            weight = torch.clamp(ratio, max=cfg.cispo_max).detach()
        else:
            weight = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high).detach()
        return -weight * adv * logps, ratio, (weight != ratio).expand_as(m)
    if cfg.policy == "sapo":
        # soft gate sigmoid(tau (rho - 1)) * 4 / tau: slope 1 at rho = 1, fading off-policy
        tau = torch.full_like(ratio, cfg.sapo_tau_neg).masked_fill(adv > 0, cfg.sapo_tau_pos)
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        return -gate * adv, ratio, torch.zeros_like(m, dtype=torch.bool)
    raise ValueError(
        f"policy: expected one of 'clip', 'gspo', 'gspo_token', 'cispo', 'sapo', got {cfg.policy!r}"
    )
