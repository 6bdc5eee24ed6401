"""CPPO refill in OpenRLHF: through the trainer's samples generator (same prompt stream), in the
order OpenRLHF's loop keeps GPU memory (DeepSpeed offloaded before vLLM wakes), ending the episode
when it drains the stream; and the sampler's rollout counting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _openrlhf_helpers import fake_forwards, make_maker, openrlhf_args, rollout_samples, tiny_model


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
        filter=get_filter_class("cppo")(pruning_rate=0.5),
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
        filter=get_filter_class("cppo")(pruning_rate=0.5),
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

    # the refill drains the stream while samples are still buffered: the call that serves the last
    # of them reports the episode over, and the next episode starts normally
    sg = fake_samples_generator(torch.Generator().manual_seed(0), 2, args, prompts=3)
    sg.generate_samples()
    extra = sg._sample_buffer = sg.generate_prompts(1)
    assert len(extra) == 2 and not sg.generate_prompts(1)
    served, _, _, exhausted = sg.generate_samples()
    assert served == extra and exhausted
    assert sg.generate_samples()[2] == 2  # a new episode, not an empty one


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
