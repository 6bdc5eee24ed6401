"""CompletionFilter in OpenRLHF: advantages equal ``group_norm``'s, and the filtered Experience list
goes through OpenRLHF's replay buffer into ``ActorPPOTrainer.training_step``."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from _openrlhf_helpers import KeepFloat64, openrlhf_args, rollout_samples, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

REWARDS = [0.0, 0.25, 0.5, 1.0, -1.0, 2.0]


def make_maker(cls, args, **kwargs):
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    strategy = SimpleNamespace(args=args)
    return cls(
        None,
        None,
        None,
        None,
        FixedKLController(kwargs.pop("kl_coef", 0.0)),
        strategy,
        SimpleNamespace(pad_token_id=0),
        **kwargs,
    )


def fake_forwards(maker_cls, actor, kl_seed=None):
    """A maker whose ``make_experience`` runs the old-policy forward locally instead of via Ray
    (the rest of OpenRLHF's method is about dispatch), filling what the real one fills."""

    class Local(maker_cls):
        forwarded_rows = 0

        def make_experience(self, samples_list):
            gen = torch.Generator().manual_seed(kl_seed or 0)
            for s in samples_list:
                Local.forwarded_rows += len(s.sequences)
                with torch.no_grad():
                    s.action_log_probs = actor(s.sequences, s.action_mask, attention_mask=s.attention_mask)
                s.base_action_log_probs = None
                s.values = None
                s.kl = torch.zeros_like(s.action_log_probs)
                if kl_seed is not None:
                    s.kl = (
                        torch.rand(s.action_log_probs.shape, generator=gen, dtype=torch.float64)
                        * s.action_mask
                    )
                s.info["kl"] = s.kl.sum(-1)
            return samples_list

    return Local


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
    maker = make_maker(maker_cls, args, completion_filter=get_filter_class("cppo")(pruning_rate=0.5))
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


def fake_samples_generator(gen, group_size, args, prompts=100, calls=None):
    """OpenRLHF's prompt stream and generation bookkeeping (GRPOPartsSamplesGenerator) over a stand-in
    for the vLLM dispatch (``_generate_vllm``): ``prompts`` prompts in the episode."""
    from grpo_parts_adapters.openrlhf.samples import GRPOPartsSamplesGenerator

    class Fake(GRPOPartsSamplesGenerator):
        def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **kw):
            taken = [p for _, p in zip(range(num_prompts), dataloader_iter)]
            self.requests.append((num_prompts, kw))
            if calls is not None:
                calls.append(("generate", len(taken)))
            rewards = torch.rand(len(taken) * group_size, generator=gen).tolist()
            more = rollout_samples(gen, group_size, len(taken), rewards) if taken else []
            for i, s in enumerate(more):
                s.prompts = [f"refill {len(self.requests)}.{i // group_size}"]
            return more, len(taken), len(taken) < num_prompts  # drained: fewer prompts than asked

    sg = Fake(SimpleNamespace(args=args), list(range(prompts)), None, None, [])
    sg.requests = []
    return sg


def test_refill_through_samples_generator():
    """CPPO keeps half of each round; the maker asks the trainer's samples generator for more prompts
    (same dataloader stream) until the kept batch has the original B * G rows."""
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.models import Actor

    from grpo_parts.filter import IMPLEMENTATIONS, get_filter_class

    if "cppo" not in IMPLEMENTATIONS:
        pytest.skip("the 'cppo' CompletionFilter is not registered yet")
    group_size, num_prompts = 4, 2
    gen = torch.Generator().manual_seed(7)
    actor = Actor(tiny_model("qwen2", dtype=torch.float32))
    actor.packing_samples = False
    args = openrlhf_args(group_size, num_prompts)
    sg = fake_samples_generator(gen, group_size, args)
    sg._dataloader_iter = iter(range(100))
    maker = make_maker(
        fake_forwards(GRPOPartsExperienceMaker, actor),
        args,
        completion_filter=get_filter_class("cppo")(pruning_rate=0.5),
        samples_generator=sg,
        generate_kwargs={"max_new_tokens": 8},
        refill_rounds=3,
    )
    samples = rollout_samples(gen, group_size, num_prompts, torch.rand(8, generator=gen).tolist())
    experiences = maker.make_experience_batch(samples)
    prompts = [p for e in experiences for p in e.prompts]
    assert len(prompts) == group_size * num_prompts  # filled back to B * G
    assert sg.requests and sg.requests[0] == (2, {"max_new_tokens": 8})
    assert any(p.startswith("refill") for p in prompts)
    assert maker.last_info["refill_prompts"] == sum(n for n, _ in sg.requests)
    assert all(torch.isfinite(e.advantages).all() for e in experiences)
    assert maker.counters.flush() == {
        "parts/filter/calls": 1.0 + len(sg.requests),
        "parts/filter/fallbacks": 0.0,
    }


class RecordingGroup:
    """An OpenRLHF RayActorGroup stand-in recording the methods called on it (no Ray)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def async_run_method(self, method_name, *args, **kwargs):
        self.calls.append((self.name, method_name))
        return []


@pytest.mark.parametrize("ds_sleep", [True, False])
def test_refill_wakes_vllm_only_after_deepspeed_offload(monkeypatch, ds_sleep):
    """Colocated with sleep mode: before a refill wakes the vLLM engines, the trained models'
    DeepSpeed states are offloaded (under --ds.enable_sleep) and the model actors' caches emptied;
    the engines sleep again after generating, as in OpenRLHF's generate_samples."""
    from grpo_parts_adapters.openrlhf import samples as samples_mod
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker

    from grpo_parts.filter import get_filter_class

    group_size, num_prompts = 2, 2
    calls = []
    monkeypatch.setattr(
        samples_mod, "batch_vllm_engine_call", lambda engines, method, **kw: calls.append(("vllm", method))
    )
    args = openrlhf_args(group_size, num_prompts, **{"vllm.enable_sleep": True, "train.colocate_all": True})
    args.ds.enable_sleep = ds_sleep
    gen = torch.Generator().manual_seed(0)
    sg = fake_samples_generator(gen, group_size, args, calls=calls)
    sg._dataloader_iter = iter(range(100))
    maker = GRPOPartsExperienceMaker(
        RecordingGroup("actor", calls),
        None,
        None,
        RecordingGroup("ref", calls),
        None,
        SimpleNamespace(args=args),
        SimpleNamespace(pad_token_id=0),
        completion_filter=get_filter_class("cppo")(pruning_rate=0.5),
        samples_generator=sg,
        refill_rounds=1,
    )
    maker._generate_more(1)
    offload = [("actor", "offload_states")] if ds_sleep else []
    assert calls == [*offload, ("actor", "empty_cache"), ("ref", "empty_cache"), ("vllm", "wake_up"),
                     ("generate", 1), ("vllm", "sleep")]  # fmt: skip


def test_refill_that_drains_the_stream_ends_the_episode():
    """A refill that takes the episode's last prompts: the next generate_samples reports the episode
    exhausted (OpenRLHF's would restart the dataloader inside the episode); the one after starts the
    next episode."""
    args = openrlhf_args(2, 2)
    sg = fake_samples_generator(torch.Generator().manual_seed(0), 2, args, prompts=3)
    first, _, consumed, exhausted = sg.generate_samples()
    assert consumed == 2 and not exhausted and len(first) == 4
    assert len(sg.generate_prompts(5)) == 2  # one prompt left
    assert sg.generate_samples() == ([], None, 0, True)
    again, _, consumed, _ = sg.generate_samples()  # next episode: the stream starts over
    assert consumed == 2 and len(again) == 4


def test_sampler_rollouts_are_counted():
    from grpo_parts_adapters.openrlhf.agent import SAMPLER_MARK

    args = openrlhf_args(2, 2)
    sg = fake_samples_generator(torch.Generator().manual_seed(0), 2, args)
    samples, *_ = sg.generate_samples()
    assert sg.counters.flush() == {}  # plain vLLM: no grpo_parts sampler ran
    for s in samples[:3]:
        s.info[SAMPLER_MARK] = torch.tensor([1.0])
    sg.count(samples)
    assert sg.counters.flush() == {"parts/sampler/rollouts": 3.0, "parts/sampler/fallbacks": 0.0}
    assert all(SAMPLER_MARK not in s.info for s in samples)


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
