"""GRPO maths shared by every part and adapter: advantages, the policy losses, KL estimators,
rollout correction and loss aggregation -- one place for each formula.

Shapes: ``rewards, group_index: [N]`` (one per completion; groups need not be contiguous or
equal-sized); ``logps, old_logps, ref_logps, rollout_logps, entropy, mask: [N, T]`` per completion
token. The loss is differentiable w.r.t. ``logps`` and ``entropy`` and never NaN for well-formed
input (a zero-variance group gets advantage exactly 0). Each option reproduces one framework setting
(verl 0.9.1, TRL 1.16, OpenRLHF 0.11.2): docs/core_maths.md maps them, tests/core/ checks them.
"""

from __future__ import annotations

from .advantages import (
    compute_advantages,
    group_advantages,
    group_stats,
    kl_reward_penalty,
    kl_shaped_rewards,
)
from .config import (
    AdvantageConfig,
    AggMode,
    CorrectionConfig,
    Estimator,
    KLClamp,
    KLEstimator,
    LossConfig,
    PolicyLoss,
)
from .correction import correction_weights
from .kl import kl_estimate
from .logprobs import token_logprobs
from .losses import LossOutput, aggregate, grpo_loss

__all__ = [
    "AdvantageConfig",
    "AggMode",
    "CorrectionConfig",
    "Estimator",
    "KLClamp",
    "KLEstimator",
    "LossConfig",
    "LossOutput",
    "PolicyLoss",
    "aggregate",
    "compute_advantages",
    "correction_weights",
    "group_advantages",
    "group_stats",
    "grpo_loss",
    "kl_estimate",
    "kl_reward_penalty",
    "kl_shaped_rewards",
    "token_logprobs",
]
