"""Launcher and vLLM plumbing (config level: no Ray cluster, no GPU)."""

from __future__ import annotations

import argparse

import pytest


def globals_seen():
    """Everything the launcher must leave as it is (module attributes, classes, builtins, argv)."""
    import builtins
    import sys

    import openrlhf.models
    import openrlhf.trainer.ray
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import launcher, ppo_actor, vllm_engine

    return {
        "ArgumentParser": argparse.ArgumentParser,
        "ArgumentParser.parse_args": argparse.ArgumentParser.parse_args,
        "ArgumentParser.__init__": argparse.ArgumentParser.__init__,
        "PolicyModelActor": ppo_actor.PolicyModelActor,
        "PolicyModelActor.init": ppo_actor.PolicyModelActor.__ray_metadata__.modified_class.__ray_actor_class__.__dict__[
            "init_model_from_pretrained"
        ],
        "ReferenceModelActor": launcher.ReferenceModelActor,
        "RayActorGroup": launcher.RayActorGroup,
        "PPOTrainer": ppo_trainer.PPOTrainer,
        "create_vllm_engines": openrlhf.trainer.ray.create_vllm_engines,
        "vllm_engine.create_vllm_engines": vllm_engine.create_vllm_engines,
        "RolloutRayActor": vllm_engine.RolloutRayActor,
        "Actor": openrlhf.models.Actor,
        "ppo_actor.Actor": ppo_actor.Actor,
        "launcher.Actor": launcher.Actor,
        "__import__": builtins.__import__,
        "argv": list(sys.argv),
    }


def assert_untouched(before):
    after = globals_seen()
    changed = [k for k in before if after[k] is not before[k] and after[k] != before[k]]
    assert not changed, f"changed: {changed}"


def test_launcher_help_lists_openrlhf_and_grpo_parts_flags(capsys):
    before = globals_seen()
    from grpo_parts_adapters.openrlhf import launch

    assert_untouched(before)  # importing patches nothing
    with pytest.raises(SystemExit) as e:
        launch.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m grpo_parts_adapters.openrlhf.launch")
    for flag in (
        "--grpo_parts.filter",
        "--grpo_parts.attention",
        "--grpo_parts.speculative_config",
        "--rollout.n_samples_per_prompt",
    ):
        assert flag in text
    assert_untouched(before)


def test_flags_reach_parts_config_through_hierarchize():
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.openrlhf.launch import add_parts_flags, parts_from_namespace
    from openrlhf.utils.config import hierarchize

    p = argparse.ArgumentParser()
    p.add_argument("--rollout.n_samples_per_prompt", type=int, default=8)
    add_parts_flags(p)
    ns = p.parse_args(
        ["--grpo_parts.filter", "cppo", "--grpo_parts.filter_kwargs", '{"pruning_rate": 0.5}', "--grpo_parts.attention", "shared_prefix",
         "--grpo_parts.speculative_config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}']
    )  # fmt: skip
    parts = parts_from_namespace(ns)
    assert OpenRLHFPartsConfig.from_args(hierarchize(ns)) == parts
    assert parts.filter_kwargs == {"pruning_rate": 0.5} and parts.speculative_config["method"] == "ngram"
    assert parts.build_filter().pruning_rate == 0.5
    assert OpenRLHFPartsConfig.from_args(argparse.Namespace()) == OpenRLHFPartsConfig()


def test_bad_flags_are_refused():
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.openrlhf.launch import check_supported
    from pydantic import ValidationError

    from grpo_parts.errors import GRPOPartsError

    with pytest.raises(ValidationError, match="filter_kwargs: expected a JSON object"):
        OpenRLHFPartsConfig(filter_kwargs="[1, 2]")
    with pytest.raises(ValidationError, match="draft_sync"):
        OpenRLHFPartsConfig(draft_sync="sometimes")
    ns = argparse.Namespace(**{"train.async_enable": True})
    with pytest.raises(GRPOPartsError, match="async"):
        check_supported(ns, OpenRLHFPartsConfig(filter="cppo"))


def test_vllm_engines_get_speculative_config(monkeypatch):
    """create_vllm_engines (OpenRLHF's, unmodified) hands every engine our extra kwargs."""
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.openrlhf.vllm_spec import WORKER_EXTENSION, create_vllm_engines_with
    from openrlhf.trainer.ray import vllm_engine

    created = []

    class FakeActorClass:
        def options(self, **options):
            return self

        def remote(self, **kwargs):
            assert vllm_engine.RolloutRayActor is fake  # OpenRLHF's module is not changed during the call
            created.append(kwargs)
            return object()

    fake = FakeActorClass()
    monkeypatch.setattr(vllm_engine, "RolloutRayActor", fake)
    spec = {"method": "eagle", "model": "some/eagle-head", "num_speculative_tokens": 3}
    parts = OpenRLHFPartsConfig(speculative_config=spec, draft_sync="shared")
    engines = create_vllm_engines_with(parts)(
        2, 1, "some/model", 0, False, False, True, 256, shared_pg=object(), gpu_memory_utilization=0.5
    )
    assert len(engines) == 2 and len(created) == 2
    for kw in created:
        assert kw["speculative_config"] == spec and kw["worker_extension_cls"] == WORKER_EXTENSION
        assert kw["model"] == "some/model" and kw["max_model_len"] == 256  # OpenRLHF's own kwargs intact
    assert vllm_engine.RolloutRayActor is fake


def test_draft_sync_loads_shared_params_into_drafter():
    import torch
    from grpo_parts_adapters.openrlhf.vllm_spec import GRPOPartsWorkerWrap

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(2, 3, bias=False)
            self.loaded = []

        def load_weights(self, weights):
            for name, w in weights:
                self.loaded.append(name)
                dict(self.named_parameters())[name].data.copy_(w)

    target, draft = Model(), Model()
    w = GRPOPartsWorkerWrap()
    w.model_runner = type("Runner", (), {"model": target, "drafter": type("D", (), {"model": draft})()})()
    assert w._sync_draft("lm_head.weight") and torch.equal(draft.lm_head.weight, target.lm_head.weight)
    assert not w._sync_draft("model.layers.0.mlp.up_proj.weight")
    draft.lm_head.weight = target.lm_head.weight  # vLLM shares the tensor: nothing to copy
    assert not w._sync_draft("lm_head.weight")


ARGV = ["--actor.model_name_or_path", "m", "--reward.remote_url", "r.py", "--rollout.n_samples_per_prompt", "4",
        "--algo.advantage.estimator", "group_norm", "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
        "--rollout.batch_size", "2", "--grpo_parts.filter", "cppo", "--grpo_parts.filter_kwargs", '{"k": 2, "scope": "group"}',
        "--grpo_parts.attention", "shared_prefix"]  # fmt: skip


def test_launcher_runs_openrlhf_main_with_grpo_parts_classes(monkeypatch):
    """Runs OpenRLHF's train_ppo_ray main (parser, validation, train()) up to the trainer, with Ray
    replaced by recorders: the actor groups get the grpo_parts actor classes, the trainer is the
    grpo_parts trainer, strategy.args carries the parts config, and while the script runs (and
    after) no module attribute, class or builtin that other code sees has changed."""
    import ray
    from grpo_parts_adapters.openrlhf import launch, ray_actors
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from openrlhf import utils
    from openrlhf.trainer.ray import launcher

    seen = {"groups": []}

    class Stop(Exception):
        pass

    def fake_strategy(args):
        seen["args"] = args
        return type("S", (), {"args": args, "print": lambda self, *a: None})()

    def fake_group(num_nodes, num_gpus, actor_type, **kw):
        seen["groups"].append(actor_type)
        seen["during"] = globals_seen()
        return object()

    class FakeTrainer:
        @staticmethod
        def remote(*args, **kwargs):
            seen["trainer"] = True
            raise Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(utils, "get_strategy", fake_strategy)
    monkeypatch.setattr(launcher, "RayActorGroup", fake_group)
    real_trainer = ray_actors.GRPOPartsPPOTrainer
    monkeypatch.setattr(ray_actors, "GRPOPartsPPOTrainer", FakeTrainer)
    before = globals_seen()
    with pytest.raises(Stop):
        launch.main([*ARGV, "--algo.kl.init_coef", "0.01"])
    assert seen["groups"] == [ray_actors.GRPOPartsPolicyModelActor, ray_actors.GRPOPartsReferenceModelActor]
    assert seen["trainer"]
    assert real_trainer.__ray_metadata__.modified_class.__ray_actor_class__ is ray_actors.TrainerParts
    parts = OpenRLHFPartsConfig.from_args(seen["args"])
    assert parts.filter == "cppo" and parts.filter_kwargs == {"k": 2, "scope": "group"}
    assert seen["args"].reward.remote_url == ["r.py"]  # OpenRLHF's own validation ran
    before.pop("RayActorGroup")  # replaced by this test, not by the launcher
    assert_untouched(before)
    seen["during"].pop("RayActorGroup")
    assert all(seen["during"][k] is before[k] or seen["during"][k] == before[k] for k in before)


def test_parse_args_runs_openrlhfs_parser_and_checks_without_ray():
    import ray
    from grpo_parts_adapters.openrlhf.launch import parse_args

    from grpo_parts.errors import GRPOPartsError

    before = globals_seen()
    args, parts = parse_args(ARGV)
    assert not ray.is_initialized()
    assert args.reward.remote_url == ["r.py"] and args.actor.eps_clip_low_high == (0.2, 0.2)
    assert args.ds.zero_stage == 2 and args.train.micro_batch_size == 1  # OpenRLHF's defaults
    assert parts.attention == "shared_prefix" and parts.build_filter().name == "cppo"
    with pytest.raises(GRPOPartsError, match="estimator"):
        parse_args([*ARGV, "--algo.advantage.estimator", "reinforce_baseline"])
    with pytest.raises(AssertionError, match="n_samples_per_prompt > 1"):  # OpenRLHF's own check
        parse_args([*ARGV, "--rollout.n_samples_per_prompt", "1"])
    assert_untouched(before)


def test_with_globals_copies_the_function_not_the_module():
    from grpo_parts_adapters.openrlhf._scoped import with_globals

    def reads_len(x):
        return len(x)

    clone = with_globals(reads_len, len=lambda x: -1)
    assert clone([1, 2]) == -1 and reads_len([1, 2]) == 2 and len([1]) == 1
    with pytest.raises(KeyError, match="does not read"):
        with_globals(reads_len, max=max)


def test_grouped_microbatches_auto():
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig

    from grpo_parts.errors import GRPOPartsError

    assert not OpenRLHFPartsConfig().use_grouped_microbatches(dynamic_batch=False)
    assert OpenRLHFPartsConfig(attention="shared_prefix").use_grouped_microbatches(dynamic_batch=False)
    assert not OpenRLHFPartsConfig(attention="shared_prefix").use_grouped_microbatches(dynamic_batch=True)
    assert not OpenRLHFPartsConfig(attention="shared_prefix", group_rows="off").use_grouped_microbatches(
        False
    )
    with pytest.raises(GRPOPartsError, match="dynamic_batch"):
        OpenRLHFPartsConfig(group_rows="on").use_grouped_microbatches(dynamic_batch=True)
    assert OpenRLHFPartsConfig(attention="none").attention is None  # OpenRLHF's own forward
    with pytest.raises(ValueError, match="sampler='speculative': not offered behind openrlhf"):
        OpenRLHFPartsConfig(sampler="speculative")
