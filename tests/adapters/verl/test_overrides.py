"""verl adapter: the documented override set (built by scripts/gpu/verl_gpu_smoke.py) composes against
verl 0.9.1's own Hydra config, and the filter options it sets validate."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")

ROOT = Path(__file__).resolve().parents[3]


def _smoke_module():
    spec = importlib.util.spec_from_file_location(
        "verl_gpu_smoke", ROOT / "scripts" / "gpu" / "verl_gpu_smoke.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("filt", ["cppo", "zero_variance", "pods"])
def test_override_set_composes_with_verl_config(filt, tmp_path):
    from grpo_parts_adapters.verl.config import TARGET, FSDPActorConfig
    from grpo_parts_adapters.verl.sampler import options_from_sampler_kwargs
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    smoke = _smoke_module()
    args = argparse.Namespace(
        steps=2, filter=filt, attention="shared_prefix", agent_loop=True, speculative="ngram"
    )
    overrides = smoke.overrides(args, tmp_path / "m", tmp_path / "d.parquet", tmp_path / "r.py", tmp_path)
    assert not any("GRPO_PARTS" in o for o in overrides)  # config keys only, no environment variable
    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None
    ):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    assert cfg.algorithm.adv_estimator == "grpo_parts_grpo"
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"  # verl's default trainer
    assert cfg.trainer.v1.sampler.custom_sampler.name == "FilteringReplayBuffer"
    opts = options_from_sampler_kwargs(cfg.trainer.v1.sampler.sampler_kwargs)
    assert opts.build().name == filt and opts.refill_granularity == cfg.data.train_batch_size
    for role in ("actor", "ref"):
        node = cfg.actor_rollout_ref[role]
        assert node._target_ == TARGET and node.grpo_parts.attention == "shared_prefix"
    # what verl's validate_config (driver) and ActorRolloutRefWorker.init_model (workers) build
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, FSDPActorConfig) and actor.engine.grpo_parts.attention == "shared_prefix"
    assert cfg.actor_rollout_ref.model.external_lib == "grpo_parts_adapters.verl.plugin"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "grpo_parts_agent"
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method == "ngram"


def test_trainer_mode_builds_from_verl_config():
    """``get_trainer_cls(trainer.v1.trainer_mode)`` -> the ``grpo_parts_sync`` trainer (filter for
    configs that keep verl's own ``grpo`` estimator), constructed from verl's composed config (no
    Ray, no GPU): it behaves as verl's sync trainer with a filtering buffer."""
    pytest.importorskip("transfer_queue")
    from grpo_parts_adapters.verl import plugin  # noqa: F401  (registers)
    from grpo_parts_adapters.verl.trainer import GrpoPartsSyncTrainer
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    cfg = _compose(
        [
            "trainer.v1.trainer_mode=grpo_parts_sync",
            "algorithm.adv_estimator=grpo",
            "+grpo_parts.filter.name=cppo",
            "+grpo_parts.filter.kwargs.k=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
    assert isinstance(trainer, GrpoPartsSyncTrainer) and trainer.trainer_mode == "sync"
    assert (
        isinstance(trainer.replay_buffer, ReplayBuffer)
        and trainer.replay_buffer.remembers_full_groups is False
    )
    assert trainer.grpo_parts_filter.name == "cppo"


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None
    ):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_settings_the_shared_prefix_cannot_honour_are_refused_when_verl_builds_the_config():
    """Refused once, at start-up, with the reason: Ulysses (in the actor config, as verl's driver
    builds it in validate_config), fused kernels (validate with the model config), verl's own
    Prefix Grouper, a non-FSDP strategy. Unknown options are Hydra-time errors too."""
    from grpo_parts_adapters.verl.config import hydra_overrides
    from verl.utils.config import omega_conf_to_dataclass

    base = [*hydra_overrides("shared_prefix"), "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    cases = {
        "ulysses_sequence_parallel_size=2": ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
        "use_prefix_grouper=True": ["actor_rollout_ref.actor.use_prefix_grouper=True"],
        "use_fused_kernels=True": ["actor_rollout_ref.actor.use_fused_kernels=True"],
        "bogus: unknown field; expected one of": ["+actor_rollout_ref.actor.grpo_parts.bogus=1"],
        "expected one of": ["actor_rollout_ref.actor.grpo_parts.attention=nope"],
    }
    for reason, extra in cases.items():
        cfg = _compose(base + extra)
        with pytest.raises(Exception, match=reason.replace("(", ".").replace(")", ".")) as e:
            omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        assert "grpo_parts" in str(e.value) or "attention" in str(e.value)
    # verl's actor config follows the model's use_fused_kernels; validate() (which verl's driver calls
    # with the model config) checks the model config itself too
    with pytest.raises(Exception, match="use_fused_kernels=True"):
        omega_conf_to_dataclass(
            _compose(base + ["actor_rollout_ref.model.use_fused_kernels=True"]).actor_rollout_ref.actor
        )
    cfg = _compose(base)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.validate(1, cfg.data.train_batch_size, cfg.actor_rollout_ref.model)
    with pytest.raises(ValueError, match="use_fused_kernels=True"):
        actor.validate(1, cfg.data.train_batch_size, {"use_fused_kernels": True})
    # switched off (attention=null): verl's own settings are not second-guessed
    off = _compose(
        [
            *hydra_overrides(None),
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    assert omega_conf_to_dataclass(off.actor_rollout_ref.actor).engine.grpo_parts.attention is None


def test_smoke_checks_read_verl_metrics(tmp_path):
    """The GPU smoke script's pass/fail logic on verl's file-logger lines (CPU-checkable part)."""
    import json

    smoke = _smoke_module()
    args = argparse.Namespace(steps=2, filter="cppo", attention="shared_prefix")
    good = {
        "actor/pg_loss": 0.1,
        "actor/parts/attention/forwards": 2.0,
        "actor/parts/attention/fallbacks": 0.0,
        "actor/parts/attention/logprob_forwards": 4.0,
        "parts/filter/rows_kept": 8.0,
    }
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": i, "data": good}) + "\n" for i in (1, 2)))
    assert all(smoke.check_run(smoke.read_metrics(path), args).values())
    bad = dict(good, **{"actor/parts/attention/fallbacks": 1.0, "actor/pg_loss": float("nan")})
    failed = {k for k, ok in smoke.check_run([good, bad], args).items() if not ok}
    assert failed == {"attention_no_fallback", "loss_finite"}
    assert not smoke.check_run([good], args)["steps_logged"]
    fb = {"finite": True, "max_abs_diff_log_probs": 1e-6, "micro_batches": 2, "parts/attention/forwards": 2.0}
    fb["parts/attention/fallbacks"] = 0.0
    assert all(smoke.check_first_batch(fb, 1e-4).values())
    assert not smoke.check_first_batch(dict(fb, max_abs_diff_log_probs=1e-2), 1e-4)[
        "first_batch_logprobs_equal"
    ]


def test_kept_rows_divide_into_verls_log_prob_micro_batches():
    """The kept count is rounded so each rank's rows split into whole old-policy / reference log-prob
    micro-batches (verl asserts it without token balancing); the sizes come from verl's own keys."""
    from grpo_parts_adapters.verl.filtering import FilterOptions
    from grpo_parts_adapters.verl.sampler import hydra_overrides, options_from_sampler_kwargs

    base = dict(ppo_mini_batch_size=2, rollout_n=4, n_gpus_per_node=2)
    assert FilterOptions(**base).batch_multiple == 8
    assert FilterOptions(**base, log_prob_micro_batch_size_per_gpu=3).batch_multiple == 24  # lcm(8, 3 x 2)
    assert (
        FilterOptions(
            **base, log_prob_micro_batch_size_per_gpu=3, log_prob_use_dynamic_bsz=True
        ).batch_multiple
        == 8
    )
    assert FilterOptions(**base, ref_log_prob_micro_batch_size_per_gpu=5).batch_multiple == 40
    with pytest.raises(ValueError, match="target_rows: expected a multiple of 24"):
        FilterOptions(**base, log_prob_micro_batch_size_per_gpu=3, target_rows=16)
    cfg = _compose(
        hydra_overrides("cppo", {"k": 2})
        + [
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
        ]
    )
    opts = options_from_sampler_kwargs(cfg.trainer.v1.sampler.sampler_kwargs)
    assert opts.log_prob_micro_batch_size_per_gpu == 3 and opts.batch_multiple == 24
