"""CompletionFilter in OpenRLHF: advantages equal ``group_norm``'s, and the filtered Experience list
goes through OpenRLHF's replay buffer into ``ActorPPOTrainer.training_step``."""

from __future__ import annotations

import copy

import pytest
import torch
from _openrlhf_helpers import (
    KeepFloat64,
    fake_forwards,
    make_maker,
    openrlhf_args,
    rollout_samples,
    tiny_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st

REWARDS = [0.0, 0.25, 0.5, 1.0, -1.0, 2.0]


@settings(max_examples=20)
@given(
    seed=st.integers(0, 10_000),
    group_size=st.integers(2, 5),
    num_prompts=st.integers(1, 4),
    micro=st.integers(1, 6),
    estimator=st.sampled_from(["group_norm", "dr_grpo", "rloo"]),
    kl_coef=st.sampled_from([0.0, 0.05]),
    overlong=st.sampled_from([None, 3]),
    clip=st.sampled_from([(-10.0, 10.0), (-0.5, 0.75)]),
    data=st.data(),
)
def test_advantages_equal_group_norm(
    seed, group_size, num_prompts, micro, estimator, kl_coef, overlong, clip, data
):
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    n = group_size * num_prompts
    rewards = data.draw(st.lists(st.sampled_from(REWARDS) | st.floats(-3, 3), min_size=n, max_size=n))
    args = openrlhf_args(
        group_size,
        num_prompts,
        **{
            "algo.advantage.estimator": estimator,
            "rollout.micro_batch_size": micro,
            "reward.overlong_buffer_len": overlong,
            "reward.clip_range": clip,
        },
    )
    gen = torch.Generator().manual_seed(seed)
    samples = rollout_samples(gen, group_size, num_prompts, rewards)
    base = make_maker(RemoteExperienceMaker, args, kl_coef=kl_coef)
    ours = make_maker(GRPOPartsExperienceMaker, args, kl_coef=kl_coef)
    exps = base.split_rollout_samples(samples)
    for e in exps:  # what make_experience leaves behind (kl in the reward when not used as a loss)
        e.kl = torch.rand(e.action_mask.shape, generator=gen, dtype=torch.float64) * e.action_mask
    want = base.compute_advantages_and_returns(copy.deepcopy(exps))
    got = ours.compute_advantages_and_returns(copy.deepcopy(exps))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.advantages, w.advantages, atol=1e-9, rtol=0)
        torch.testing.assert_close(g.returns, w.returns, atol=1e-9, rtol=0)
        torch.testing.assert_close(g.info["return"], w.info["return"], atol=1e-9, rtol=0)
        torch.testing.assert_close(g.rewards, w.rewards)
        torch.testing.assert_close(g.info["group_reward_std"], w.info["group_reward_std"], atol=1e-9, rtol=0)
        assert g.kl is None and "grpo_parts_advantage" not in g.info


def test_keep_all_make_experience_batch_equals_openrlhf():
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    actor = Actor(tiny_model("qwen2"))
    actor.packing_samples = False
    args = openrlhf_args(3, 2)
    rewards = [0.0, 1.0, 1.0, 0.5, 0.5, 0.5]
    outs = []
    for cls in (RemoteExperienceMaker, GRPOPartsExperienceMaker):
        samples = rollout_samples(torch.Generator().manual_seed(0), 3, 2, rewards)
        outs.append(make_maker(fake_forwards(cls, actor), args).make_experience_batch(samples))
    for g, w in zip(outs[1], outs[0]):
        torch.testing.assert_close(g.advantages, w.advantages, atol=1e-9, rtol=0)
        torch.testing.assert_close(g.action_log_probs, w.action_log_probs)


def test_filtered_experiences_train_in_openrlhf_actor_step(monkeypatch):
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.models import Actor

    from grpo_parts.core import AdvantageConfig, group_advantages
    from grpo_parts.filter import IMPLEMENTATIONS, get_filter_class

    if "cppo" not in IMPLEMENTATIONS:
        pytest.skip("the 'cppo' CompletionFilter is not registered yet")
    model = tiny_model("qwen2", dtype=torch.float32)
    actor = Actor(model)
    actor.packing_samples = False
    group_size, num_prompts = 4, 3
    rewards = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.9, 0.4, 0.0]  # prompt 1 has zero variance
    args = openrlhf_args(group_size, num_prompts)
    maker_cls = fake_forwards(GRPOPartsExperienceMaker, actor)
    maker = make_maker(maker_cls, args, filter=get_filter_class("cppo")(pruning_rate=0.5))
    samples = rollout_samples(
        torch.Generator().manual_seed(1), group_size, num_prompts, rewards, env_tokens=True
    )
    full_adv = group_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.arange(3).repeat_interleave(4),
        AdvantageConfig(eps=1e-9),
    )
    experiences = maker.make_experience_batch(samples)

    kept_prompts = [p for e in experiences for p in e.prompts]
    assert maker_cls.forwarded_rows == len(kept_prompts) == 6  # the forwards ran on the kept rows only
    assert "prompt 1" not in kept_prompts  # zero-variance group pruned first
    kept_adv = torch.cat(
        [e.advantages[torch.arange(len(e.advantages)), e.action_mask.long().argmax(1)] for e in experiences]
    )
    # each kept row keeps its full-group advantage (float32 here: the actor's dtype)
    assert ((kept_adv.double()[:, None] - full_adv[None, :]).abs().min(1).values < 1e-6).all()
    torch.testing.assert_close(
        kept_adv.double().abs().sort().values, full_adv.abs().sort().values[-6:], atol=1e-6, rtol=0
    )

    trainer, buffer = actor_trainer(actor, args, monkeypatch)
    for e in experiences:
        buffer.append(e)
    before = [p.detach().clone() for p in model.parameters()]
    batch = buffer.collate_fn([buffer[i] for i in range(len(buffer))])
    status = trainer.training_step(batch, kl_ctl=0.0, step=0)
    assert torch.isfinite(status["metrics"]["policy_loss"])
    assert status["num_samples"] == 6
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def actor_trainer(actor, args, monkeypatch):
    """OpenRLHF's ``ActorPPOTrainer`` and ``NaiveReplayBuffer`` on CPU. Their constructors call CUDA
    (device ids, barriers) and DeepSpeed; the stub strategy does plain ``backward`` + AdamW step."""
    from openrlhf.models import PolicyLoss
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    buffer = NaiveReplayBuffer(2, cpu_offload=False)
    buffer.target_device = torch.device("cpu")
    optim = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)

    class Strategy:
        ring_attn_group = None

        def __init__(self):
            self.args = args

        def backward(self, loss, model, optimizer):
            loss.backward()

        def optimizer_step(self, optimizer, model, scheduler, name=""):
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

        def get_grad_norm(self, model):
            return 0.0

    trainer = ActorPPOTrainer.__new__(ActorPPOTrainer)
    trainer.strategy, trainer.args, trainer.actor = Strategy(), args, actor
    trainer.actor_optim, trainer.actor_scheduler, trainer.ema_model = optim, sched, None
    trainer.replay_buffer, trainer.aux_loss = buffer, False
    a = args.actor
    trainer.actor_loss_fn = PolicyLoss(
        clip_eps_low=a.eps_clip_low_high[0], clip_eps_high=a.eps_clip_low_high[1], token_level_loss=True
    )
    return trainer, buffer


def test_group_index_checks_prompts():
    from grpo_parts_adapters.openrlhf.experience import group_index_of

    from grpo_parts.errors import GRPOPartsError

    samples = rollout_samples(torch.Generator().manual_seed(0), 2, 2, [0.0] * 4)
    assert group_index_of(samples, 2).tolist() == [0, 0, 1, 1]
    with pytest.raises(GRPOPartsError, match="multiple of n_samples_per_prompt=3"):
        group_index_of(samples, 3)
    samples[1].prompts = ["other"]
    with pytest.raises(GRPOPartsError, match="should share one prompt"):
        group_index_of(samples, 2)


_ = KeepFloat64  # imported for symmetry with the actor tests


def test_grouped_replay_buffer_keeps_groups_in_micro_batches(monkeypatch):
    """Through OpenRLHF's own DataLoader settings (as in ppo_train): shuffled micro-batches, each one
    prompt's completions, accepted by the training step."""
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from grpo_parts_adapters.openrlhf.replay import GroupedReplayBuffer
    from openrlhf.models import Actor
    from torch.utils.data import DataLoader

    group_size, num_prompts = 4, 3
    actor = Actor(tiny_model("qwen2", dtype=torch.float32))
    actor.packing_samples = False
    args = openrlhf_args(group_size, num_prompts, **{"train.micro_batch_size": group_size})
    maker = make_maker(fake_forwards(GRPOPartsExperienceMaker, actor), args)
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(2)).tolist()
    experiences = maker.make_experience_batch(
        rollout_samples(torch.Generator().manual_seed(2), 4, 3, rewards)
    )
    trainer, plain = actor_trainer(actor, args, monkeypatch)
    plain.sample_batch_size = group_size
    buffer = GroupedReplayBuffer.replacing(plain)
    trainer.replay_buffer = buffer
    for e in experiences:
        buffer.append(e)
    loader = DataLoader(
        buffer,
        batch_size=buffer.sample_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=buffer.collate_fn,
    )
    batches = list(loader)
    assert len(batches) == num_prompts
    for b in batches:
        assert len(set(b.prompts)) == 1 and len(b.prompts) == group_size
    status = trainer.training_step(batches[0], kl_ctl=0.0, step=0)
    assert torch.isfinite(status["metrics"]["policy_loss"])
