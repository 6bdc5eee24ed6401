"""CPPO under every advantage estimator: the advantage that ranks a row is the one it trains on.

``fill_rollouts`` computes each round's advantages once (KL in the reward included) and hands the
same tensor to the filter and to the loss, so ranking, refill and the update agree for GRPO, Dr.
GRPO, RLOO and REINFORCE++-baseline alike.
"""

from __future__ import annotations

import pytest
import torch
from filter_fakes import fake_reward, fake_rollout

from grpo_parts.core import AdvantageConfig, compute_advantages, group_stats
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.filter.refill import Refiller, fill_rollouts
from grpo_parts.types import Rollout

G = 8
PROMPTS = [1, 2, 3, 4, 5, 6]  # 3 and 6 are zero-variance groups under fake_reward
CONFIGS = {
    "grpo": AdvantageConfig(),
    "dr_grpo": AdvantageConfig(norm="none"),
    "rloo": AdvantageConfig(estimator="rloo"),
    "reinforce_pp": AdvantageConfig(estimator="reinforce_plus_plus_baseline"),
    "reinforce_pp_openrlhf": AdvantageConfig(estimator="reinforce_plus_plus_baseline", whiten="openrlhf"),
}


def kl_logprobs(ro: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic stand-in for the trainer's old/reference log-probs of a rollout's rows."""
    gen = torch.Generator().manual_seed(int(ro.completion_ids.sum()))
    ref = ro.logprobs + 0.3 * torch.randn(ro.logprobs.shape, generator=gen, dtype=ro.logprobs.dtype)
    return ro.logprobs, ref


def _fill(cfg: AdvantageConfig, kl: bool):
    return fill_rollouts(
        TopKAbsAdvantage(pruning_rate=0.5, scope="group"),
        Refiller(target_size=len(PROMPTS) * G, initial_prompts=len(PROMPTS), max_rounds=1),
        iter(PROMPTS),
        lambda ps: fake_rollout(ps, G),
        fake_reward,
        cfg,
        kl_logprobs=kl_logprobs if kl else None,
    )


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cppo_ranks_by_the_advantage_that_enters_the_loss(name: str, kl_coef: float) -> None:
    cfg = CONFIGS[name].model_copy(update={"kl_coef": kl_coef})
    out = _fill(cfg, kl_coef > 0)
    full = fake_rollout(PROMPTS, G)
    rewards = fake_reward(PROMPTS, full)
    old, ref = kl_logprobs(full)
    want = compute_advantages(
        rewards, full.group_index, full.completion_mask, cfg, old_logps=old, ref_logps=ref
    )
    (sel,) = out.outcome.selections
    kept = sel.kept
    assert torch.equal(out.advantages, want[kept])  # trained on exactly the ranked values
    is_kept = torch.zeros(len(rewards), dtype=torch.bool)
    is_kept[kept] = True
    # the zero-variance rule sees what the estimator normalised (KL-penalised rewards when kl_coef > 0)
    shaped = sel.round.scored.rewards
    zero_var = group_stats(shaped, full.group_index)[3][full.group_index]
    eligible = ~zero_var & (want != 0)
    assert not bool((is_kept & ~eligible).any())
    for g in range(len(PROMPTS)):
        rows = full.group_index == g
        kept_abs, pruned_abs = want[rows & is_kept].abs(), want[rows & ~is_kept & eligible].abs()
        if kept_abs.numel() and pruned_abs.numel():
            assert float(kept_abs.min()) >= float(pruned_abs.max())  # CPPO: the largest |A| kept
    zero_var_prompts_kept = bool(is_kept[(full.group_index == 2) | (full.group_index == 5)].any())
    assert zero_var_prompts_kept == (kl_coef > 0)  # a KL penalty gives all-equal rewards a signal


def test_kl_in_reward_needs_log_probs() -> None:
    with pytest.raises(GRPOPartsError, match="kl_logprobs: expected a callable"):
        _fill(AdvantageConfig(kl_coef=0.1), kl=False)
    with pytest.raises(GRPOPartsError, match="kl_placement: 'token'"):
        _fill(AdvantageConfig(kl_coef=0.1, kl_placement="token"), kl=True)
