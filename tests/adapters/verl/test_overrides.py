"""verl adapter: the documented override set (built by scripts/verl_gpu_smoke.py) composes against
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
    spec = importlib.util.spec_from_file_location("verl_gpu_smoke", ROOT / "scripts" / "verl_gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("filt", ["cppo", "zero_variance", "pods"])
def test_override_set_composes_with_verl_config(filt, tmp_path):
    from grpo_parts_adapters.verl.trainer import filter_options_from
    from hydra import compose, initialize_config_dir

    smoke = _smoke_module()
    args = argparse.Namespace(
        steps=2, filter=filt, attention="shared_prefix", agent_loop=True, speculative="ngram"
    )
    overrides = smoke.overrides(args, tmp_path / "m", tmp_path / "d.parquet", tmp_path / "r.py", tmp_path)
    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None
    ):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    assert cfg.algorithm.adv_estimator == "grpo_parts_grpo"
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "grpo_parts_sync"
    assert cfg.actor_rollout_ref.model.external_lib == "grpo_parts_adapters.verl.plugin"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "grpo_parts_agent"
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method == "ngram"
    assert filter_options_from(cfg).build().name == filt


def test_trainer_mode_builds_from_the_override_set(tmp_path):
    """``get_trainer_cls(trainer.v1.trainer_mode)`` -> our trainer, constructed from verl's own
    composed config (no Ray, no GPU): it behaves as verl's sync trainer with a filtering buffer."""
    pytest.importorskip("transfer_queue")
    from grpo_parts_adapters.verl import plugin  # noqa: F401  (registers)
    from grpo_parts_adapters.verl.trainer import GrpoPartsSyncTrainer
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    smoke = _smoke_module()
    args = argparse.Namespace(steps=2, filter="cppo", attention=None, agent_loop=False, speculative=None)
    overrides = smoke.overrides(args, tmp_path / "m", tmp_path / "d.parquet", tmp_path / "r.py", tmp_path)
    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None
    ):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
    assert isinstance(trainer, GrpoPartsSyncTrainer) and trainer.trainer_mode == "sync"
    assert type(trainer.replay_buffer._inner) is ReplayBuffer
    assert trainer.grpo_parts_filter.name == "cppo"
