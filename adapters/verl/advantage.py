"""The ``grpo_parts_grpo`` advantage estimator: :func:`grpo_parts.core.group_advantages` behind verl's
estimator signature, ``fn(token_level_rewards, response_mask, config, index=uid) -> (advantages,
returns)``, both ``[B, T]``. All-equal and singleton groups get exactly 0 (verl's ``grpo``: about
``1e-10`` and ``r / (1 + eps)``). Rows the filtering sampler kept from a larger group get their
advantage within the full group (:func:`remember_full_groups`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.errors import GRPOPartsError, check_tensor

NAME = "grpo_parts_grpo"

#: uid -> (rewards, advantages) of the full group, recorded by the filtering sampler of this process
_FULL_GROUPS: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
_FULL_NORM: dict[str, bool] = {}


def remember_full_groups(
    groups: dict[Any, tuple[torch.Tensor, torch.Tensor]], *, norm_adv_by_std: bool
) -> None:
    """Record the full-group ``(rewards, advantages)`` of each kept ``uid`` for the next call of the
    estimator. Raises when the previous sample's groups never reached it: verl then trained on
    advantages re-normalised within the kept rows (set ``algorithm.adv_estimator=grpo_parts_grpo``)."""
    if _FULL_GROUPS:
        stale = list(_FULL_GROUPS)[:3]
        _FULL_GROUPS.clear()
        raise GRPOPartsError(
            f"algorithm.adv_estimator: the grpo_parts filter kept groups {stale}... whose full-group "
            f"advantages never reached the {NAME!r} estimator; expected algorithm.adv_estimator={NAME} "
            "with trainer.v1.sampler.custom_sampler (verl's own estimator re-normalises inside the kept rows)"
        )
    _FULL_GROUPS.update(groups)
    _FULL_NORM["norm_adv_by_std"] = norm_adv_by_std


def _apply_full_groups(
    adv: torch.Tensor, rewards: torch.Tensor, index: Sequence[Any], norm: bool
) -> torch.Tensor:
    """``adv`` with the rows of remembered uids replaced by their full-group advantage (a row's
    advantage within its group depends only on its reward); the uids are forgotten."""
    uids = [u for u in dict.fromkeys(list(index)) if u in _FULL_GROUPS]
    if not uids:
        return adv
    if _FULL_NORM.get("norm_adv_by_std", norm) != norm:
        raise GRPOPartsError(
            f"grpo_parts_filter.norm_adv_by_std={_FULL_NORM['norm_adv_by_std']} but "
            f"algorithm.norm_adv_by_std_in_grpo={norm}: set both alike"
        )
    out = adv.clone()
    rows_of: dict[Any, list[int]] = {}
    for i, u in enumerate(list(index)):
        rows_of.setdefault(u, []).append(i)
    for u in uids:
        full_r, full_a = _FULL_GROUPS.pop(u)
        for i in rows_of[u]:
            hit = (full_r.to(rewards.dtype) - rewards[i].cpu()).abs() <= 1e-6 * (1 + rewards[i].abs().cpu())
            if not bool(hit.any()):
                raise GRPOPartsError(
                    f"uid {u!r}: row reward {float(rewards[i])} is not one of its group's rewards"
                )
            out[i] = full_a[hit.nonzero()[0, 0]].to(out.dtype)
    return out


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
    cfg = advantage_config_from(config)
    adv = group_advantages(rewards, group_index.to(rewards.device), cfg)
    adv = _apply_full_groups(adv, rewards, list(index), cfg.norm == "group")
    scores = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return scores, scores


def register() -> None:
    """Register ``grpo_parts_grpo`` with verl's advantage-estimator registry (idempotent)."""
    from verl.trainer.ppo import core_algos

    if core_algos.ADV_ESTIMATOR_REGISTRY.get(NAME) is not compute_grpo_parts_advantage:
        core_algos.register_adv_est(NAME)(compute_grpo_parts_advantage)
