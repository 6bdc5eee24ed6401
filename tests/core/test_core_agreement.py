"""Numerical agreement of grpo_parts.core with verl 0.9.1 ``core_algos`` and TRL 1.16 ``GRPOTrainer._compute_loss``.

Both references run live on the same random inputs; forward and backward (gradient w.r.t. the
policy log-probs). Tolerances: max abs difference <= 1e-6 in float32 and <= 1e-12 in float64.
The one documented exception: verl's ``seq-mean-token-mean`` divides each sequence's token sum by
``count + 1e-8`` (we and TRL divide by ``count``), a relative difference of ``1e-8 / count`` that
float64 resolves; that case is checked against the exact size of that term here, and
``LossConfig(seq_len_eps=1e-8)`` reproduces it exactly (tests/core/test_core_variants.py).

verl and trl are installed by scripts/ci/install-dev.sh, so these tests run (never skip) in CI.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_parts.core import AdvantageConfig, LossConfig, group_advantages, grpo_loss, kl_estimate

pytestmark = pytest.mark.frameworks

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float64]


@pytest.fixture(scope="module")
def verl_algos():
    from verl.trainer.ppo import core_algos

    return core_algos


@pytest.fixture(scope="module")
def trl_trainer_cls():
    from trl import GRPOTrainer

    return GRPOTrainer


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rtol: float = 0.0) -> None:
    diff = (got.detach().double() - want.detach().double()).abs()
    bound = TOL[dtype] + rtol * want.detach().double().abs()
    assert bool((diff <= bound).all()), f"max abs diff {float(diff.max()):.3g} > {TOL[dtype]:.0e} ({dtype})"


def _groups(seed: int, sizes=(2, 3, 5, 8, 4)):
    """Shuffled, unequal groups (size >= 2), one of them zero-variance."""
    gen = torch.Generator().manual_seed(seed)
    group = torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)])
    perm = torch.randperm(len(group), generator=gen)
    rewards = torch.randn(len(group), generator=gen, dtype=torch.float64)
    rewards[group == 2] = 0.75  # all equal: advantage exactly 0 in both
    return rewards[perm], group[perm]


def _response(n: int, t: int, seed: int, dtype: torch.dtype):
    """Right-padded completions (length >= 1), random log-probs with clipping on both sides."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    logps = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 2
    old = logps + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    ref = logps + 0.5 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    return logps.to(dtype), old.to(dtype), ref.to(dtype), adv.to(dtype), mask


# ----------------------------------------------------------------------------- verl: advantages


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 1e-4])
def test_grpo_advantage_matches_verl(verl_algos, dtype, norm_by_std, eps):
    rewards, group = _groups(seed=1)
    rewards = rewards.to(dtype)
    n, t = len(rewards), 6
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (n,))[:, None]).to(dtype)
    token_rewards = torch.zeros(n, t, dtype=dtype)
    token_rewards[torch.arange(n), mask.long().sum(-1) - 1] = rewards  # outcome reward on the last token
    want, _ = verl_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, np.array(group.tolist()), epsilon=eps, norm_adv_by_std_in_grpo=norm_by_std
    )
    cfg = AdvantageConfig(norm="group" if norm_by_std else "none", unbiased_std=True, eps=eps)
    ours = group_advantages(rewards, group, cfg)
    _close(ours[:, None] * mask, want, dtype)
    assert bool((ours[group == 2] == 0).all())


def test_singleton_group_deviation_from_verl(verl_algos):
    """Documented choice: verl gives a lone completion r / (1 + eps); we give 0 (no relative signal)."""
    rewards = torch.tensor([0.5, 1.0, 2.0, -3.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 2])  # groups 1 and 2 are singletons
    mask = torch.ones(4, 1, dtype=torch.float64)
    want, _ = verl_algos.compute_grpo_outcome_advantage(
        rewards[:, None], mask, np.array([0, 0, 1, 2]), epsilon=1e-6
    )
    ours = group_advantages(rewards, group)
    assert ours[2:].tolist() == [0.0, 0.0]
    # (verl builds its singleton std as a float32 tensor, so 1 + eps is rounded to float32)
    torch.testing.assert_close(want[2:, 0], rewards[2:] / (1 + 1e-6), atol=1e-6, rtol=0)
    _close(ours[:2], want[:2, 0], torch.float64)  # the size-2 group agrees


# ----------------------------------------------------------------------------- verl: policy loss, KL


def _verl_actor_config(eps_low: float, eps_high: float, clip_c: float):
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        clip_ratio=0.2,
        clip_ratio_low=eps_low,
        clip_ratio_high=eps_high,
        clip_ratio_c=clip_c,
        rollout_n=4,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize(
    "clip", [(0.2, 0.2, None), (0.1, 0.28, 3.0), (0.2, 0.3, 1.2)], ids=["sym", "dual3", "dual1.2"]
)
def test_policy_loss_matches_verl(verl_algos, dtype, agg, clip):
    eps_low, eps_high, dual = clip
    logps, old, _, adv, mask = _response(10, 7, seed=2, dtype=dtype)
    adv_tok = adv[:, None].expand_as(logps).contiguous()
    # verl always applies dual clip (clip_ratio_c); a huge c switches it off for the no-dual case
    vcfg = _verl_actor_config(eps_low, eps_high, dual if dual is not None else 1e30)
    x_v = logps.clone().requires_grad_(True)
    want, _ = verl_algos.compute_policy_loss_vanilla(
        old, x_v, adv_tok, mask.to(dtype), loss_agg_mode=agg, config=vcfg
    )
    (g_want,) = torch.autograd.grad(want, x_v)
    x = logps.clone().requires_grad_(True)
    ours = grpo_loss(
        x, old, adv, mask, LossConfig(eps_low=eps_low, eps_high=eps_high, dual_clip=dual, agg=agg)
    ).loss
    (g,) = torch.autograd.grad(ours, x)
    # verl's seq-mean-token-mean divides by (count + 1e-8): a relative 1e-8 / count, visible in float64 only
    rtol = 1.01e-8 if (agg == "seq-mean-token-mean" and dtype == torch.float64) else 0.0
    _close(ours, want, dtype, rtol)
    _close(g, g_want, dtype, rtol)


def test_verl_seq_mean_token_mean_epsilon_is_the_only_difference(verl_algos):
    """Pin the size of the documented float64 deviation: exactly verl's 1e-8 in the token count."""
    logps, old, _, adv, mask = _response(10, 7, seed=3, dtype=torch.float64)
    adv_tok = adv[:, None].expand_as(logps).contiguous()
    want, _ = verl_algos.compute_policy_loss_vanilla(
        old, logps, adv_tok, mask.double(), "seq-mean-token-mean", _verl_actor_config(0.2, 0.2, 1e30)
    )
    per_tok = grpo_loss(logps, old, adv, mask, LossConfig()).per_token_loss
    count = mask.sum(-1).double()
    verl_like = ((per_tok * mask).sum(-1) / (count + 1e-8)).mean()
    assert abs(float(verl_like - want)) <= 1e-15
    assert abs(float(grpo_loss(logps, old, adv, mask, LossConfig(agg="seq-mean-token-mean")).loss - want)) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ours,theirs", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl"), ("k3", "k3")])
def test_kl_matches_verl(verl_algos, dtype, ours, theirs):
    logps, _, ref, _, _ = _response(8, 9, seed=4, dtype=dtype)
    ref = ref.clone()
    ref[0, :3] = torch.tensor([25.0, -25.0, 12.0], dtype=dtype)  # exercise k3's clamps
    x_v, x = logps.clone().requires_grad_(True), logps.clone().requires_grad_(True)
    want = verl_algos.kl_penalty(x_v, ref, theirs)
    got = kl_estimate(x, ref, ours)  # type: ignore[arg-type]
    (g_want,) = torch.autograd.grad(want.sum(), x_v)
    (g,) = torch.autograd.grad(got.sum(), x)
    _close(got, want, dtype)
    _close(g, g_want, dtype)


# ----------------------------------------------------------------------------- TRL: _compute_loss


def _trl_inputs(
    mask: torch.Tensor, adv: torch.Tensor, old: torch.Tensor, prompt_len: int, **extra: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The batch TRL's ``_compute_loss`` reads (token ids are placeholders: the stand-in's forward
    returns the log-probs under test)."""
    n, t = mask.shape
    return {
        "prompt_ids": torch.ones(n, prompt_len, dtype=torch.long),
        "prompt_mask": torch.ones(n, prompt_len, dtype=torch.long),
        "completion_ids": torch.ones(n, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        **extra,
    }


class _TRLStandIn:
    """Just the attributes ``GRPOTrainer._compute_loss`` reads (TRL 1.16), with no model, no
    accelerator and no data: ``_get_per_token_logps_and_entropies`` returns our tensors."""

    def __init__(self, loss_type: str, beta: float, eps_low: float, eps_high: float, max_len: int, logps):
        self.loss_type, self.beta = loss_type, beta
        self.epsilon_low, self.epsilon_high = eps_low, eps_high
        self.max_completion_length = max_len
        self.aux_loss_enabled = False
        self.top_entropy_quantile = 1.0
        self.off_policy_mask_threshold = None
        self.importance_sampling_level = "token"
        self.use_vllm = False
        self.vllm_importance_sampling_correction = False
        self._entropy_bonus_enabled = False
        self.use_adaptive_entropy = False
        self.model = SimpleNamespace(training=True)
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
        self.accelerator = SimpleNamespace(
            num_processes=1,
            gather=lambda x: x,
            gather_for_metrics=lambda x: x,
            reduce=lambda x, reduction="sum": x,
            sync_gradients=True,
        )
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._logps = logps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert self._logps.shape[1] == logits_to_keep
        return self._logps, torch.zeros_like(self._logps).detach(), None


TRL_CASES = {
    # loss_type: (our agg, how TRL normalises)
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",  # normalised by num_items_in_batch (all tokens of the generation batch)
    "dr_grpo": "seq-mean-token-sum-norm",  # sum / (B * max_completion_length)
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type", list(TRL_CASES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_matches_trl(trl_trainer_cls, dtype, loss_type, beta):
    n, t, max_len = 8, 7, 12
    logps, old, ref, adv, mask = _response(n, t, seed=5, dtype=dtype)
    eps_low, eps_high = 0.2, 0.28
    x_t = logps.clone().requires_grad_(True)
    inputs = _trl_inputs(mask, adv, old, prompt_len=3, ref_per_token_logps=ref, num_items_in_batch=mask.sum())
    stand_in = _TRLStandIn(loss_type, beta, eps_low, eps_high, max_len, x_t)
    want = trl_trainer_cls._compute_loss(stand_in, None, inputs)
    (g_want,) = torch.autograd.grad(want, x_t)

    agg = TRL_CASES[loss_type]
    cfg = LossConfig(
        eps_low=eps_low,
        eps_high=eps_high,
        kl_coef=beta,
        kl_estimator="k3",
        agg=agg,  # type: ignore[arg-type]
        norm_constant=float(max_len) if agg == "seq-mean-token-sum-norm" else None,
    )
    x = logps.clone().requires_grad_(True)
    counts = {"num_tokens": float(mask.sum())} if loss_type == "dapo" else {}
    ours = grpo_loss(x, old, adv, mask, cfg, ref if beta > 0 else None, **counts).loss
    (g,) = torch.autograd.grad(ours, x)
    _close(ours, want, dtype)
    _close(g, g_want, dtype)


def test_trl_dr_grpo_counts_empty_rows_pass_num_seqs(trl_trainer_cls):
    """TRL's dr_grpo divides by all B rows, even fully masked ones; pass ``num_seqs=B`` to match."""
    n, t = 6, 5
    logps, old, _, adv, mask = _response(n, t, seed=6, dtype=torch.float64)
    mask[2] = 0
    inputs = _trl_inputs(mask, adv, old, prompt_len=2)
    want = trl_trainer_cls._compute_loss(_TRLStandIn("dr_grpo", 0.0, 0.2, 0.2, t, logps), None, inputs)
    cfg = LossConfig(agg="seq-mean-token-sum-norm", norm_constant=float(t))
    _close(grpo_loss(logps, old, adv, mask, cfg, num_seqs=n).loss, want, torch.float64)
