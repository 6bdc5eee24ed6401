"""GRPO maths shared by every part and adapter: advantages, the policy losses, KL estimators,
rollout correction and loss aggregation -- one place for each formula.

Conventions (shapes in names):

* ``rewards: [N]`` one scalar reward per completion; ``group_index: [N]`` the prompt (group) each
  completion belongs to. Groups need not be contiguous or equal-sized.
* ``logps, old_logps, ref_logps, rollout_logps, entropy: [N, T]`` per completion token,
  ``mask: [N, T]`` 1 for tokens that count in the loss.

Everything here is differentiable where it should be (the loss w.r.t. ``logps`` and ``entropy``)
and never produces NaN for well-formed input: a zero-variance group gets advantage exactly 0.
Each option reproduces one framework setting (verl 0.9.1 ``core_algos`` / ``rollout_corr_helper``,
TRL 1.16 ``GRPOTrainer._compute_loss``, OpenRLHF 0.11.2 ``PolicyLoss`` and experience maker);
docs/core_maths.md maps them, tests/core/test_core_agreement*.py and tests/core/test_core_variants.py and
tests/adapters/openrlhf/test_core_agreement_openrlhf.py check them against the frameworks' code.
Submodules: :mod:`.config`, :mod:`.advantages`, :mod:`.policy`, :mod:`.losses`, :mod:`.kl`,
:mod:`.correction`, :mod:`.logprobs`.
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
from .losses import LossOutput, aggregate, grpo_loss, weighted_loss_reasons

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
    "weighted_loss_reasons",
]
