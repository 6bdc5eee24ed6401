"""The ``grpo_parts_grpo`` advantage estimator: verl's estimator signature around
:func:`grpo_parts.core.group_advantages`.

verl calls a registered estimator as ``fn(token_level_rewards, response_mask, config, index=uid)``
and expects ``(advantages, returns)``, both ``[B, T]``, the per-sequence advantage broadcast over
the response tokens. Differences from verl's own ``grpo`` (documented in docs/adapters/verl.md):
an all-equal group gets exactly 0 (verl: ``(r - mean) / eps`` which can be ~1e-10 after rounding in
the mean) and a singleton group gets 0 (verl: ``r / (1 + eps)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.errors import GRPOPartsError, check_tensor

NAME = "grpo_parts_grpo"


def uid_to_group_index(uid: Sequence[Any] | np.ndarray) -> tuple[torch.Tensor, list[Any]]:
    """Map verl's per-row ``uid`` (any hashable: str, int, ...) to ``group_index: [B]`` numbered by
    first appearance, plus the list of distinct uids in that order."""
    seen: dict[Any, int] = {}
    idx = [seen.setdefault(u, len(seen)) for u in list(uid)]
    return torch.tensor(idx, dtype=torch.long), list(seen)


def advantage_config_from(config: Any) -> AdvantageConfig:
    """verl's ``AlgoConfig`` (or a dict / DictConfig) -> :class:`AdvantageConfig` (eps 1e-6 as verl)."""
    get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
    norm = bool(get("norm_adv_by_std_in_grpo", True)) if config is not None else True
    return AdvantageConfig(norm="group" if norm else "none", unbiased_std=True, eps=1e-6)


def compute_grpo_parts_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray | None = None,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl estimator: outcome reward = sum over tokens, GRPO group advantage by ``uid``."""
    check_tensor("token_level_rewards", token_level_rewards, ndim=2, dtype="float")
    check_tensor("response_mask", response_mask, shape=list(token_level_rewards.shape))
    if index is None:
        raise GRPOPartsError("index: expected the per-row uid array (data.non_tensor_batch['uid']), got None")
    if len(index) != token_level_rewards.shape[0]:
        raise GRPOPartsError(
            f"index: expected {token_level_rewards.shape[0]} uids (one per row), got {len(index)}"
        )
    group_index = uid_to_group_index(index)[0]
    rewards = token_level_rewards.sum(dim=-1)
    adv = group_advantages(rewards, group_index.to(rewards.device), advantage_config_from(config))
    scores = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return scores, scores


def register() -> None:
    """Register ``grpo_parts_grpo`` with verl's advantage-estimator registry (idempotent)."""
    from verl.trainer.ppo import core_algos

    if core_algos.ADV_ESTIMATOR_REGISTRY.get(NAME) is not compute_grpo_parts_advantage:
        core_algos.register_adv_est(NAME)(compute_grpo_parts_advantage)
