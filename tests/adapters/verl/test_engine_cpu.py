"""verl adapter on verl 0.9.1's real FSDP engine, on CPU, with the data the default v1 trainer makes.

Samples are written into a real TransferQueue (Ray local, CPU) by verl's own v1 agent-loop
post-processing (``AgentLoopWorkerTQ._agent_loop_postprocess``, which stores ``multi_modal_inputs={}``
with every text sample) and read back as verl's workers read them. With the shared-prefix part on
(by config keys) vs off, on the same weights and batch:

* ``FSDPEngineWithLMHead.infer_batch`` / ``train_batch`` (``ppo_loss``, gradient checkpointing on,
  an AdamW step), fixed and dynamic micro-batch sizes, remove-padding on and off: log-probs,
  entropies, losses, grad norms and updated parameters agree to float32 tolerance, and the part
  counters say every micro-batch went through grpo_parts (no fallback);
* verl's own ``ActorRolloutRefWorker`` built from verl's composed Hydra config plus our override list
  (actor and reference engines), fed ``KVBatchMeta`` through verl's TransferQueue bridge;
* a critic (value-head) engine next to them runs verl's forward, untouched.

The engine is FSDP2 here: FSDP1's ``sync_module_states`` requires an accelerator. Both strategies
call the same ``forward_step``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
pytest.importorskip("transfer_queue")
ray = pytest.importorskip("ray")

import transfer_queue as tq  # noqa: E402
from _cpu_verl import (  # noqa: E402
    put_rollouts,
    rollouts,
    save_tiny_model,
    verl_on_cpu,
    with_info,
    with_ppo_inputs,
)
from grpo_parts_adapters.verl import engine as hook  # noqa: E402
from grpo_parts_adapters.verl.config import FSDPActorConfig, hydra_overrides  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
N = 4  # completions per prompt


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """verl on CPU + Ray (local) + TransferQueue; a tiny model; 3 prompts x 4 completions written by
    verl's v1 agent loop post-processing."""
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("verl_tiny") / "model"))
    with verl_on_cpu():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
            meta = put_rollouts(rollouts(3, N, seed=0))
            yield model_dir, meta
        finally:
            tq.close()
            ray.shutdown()
            hook.uninstall_engine_hook()


def actor_config(attention: str | None, *, dynamic: bool = False, lr: float = 1e-2) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=N,
        ppo_mini_batch_size=3,
        ppo_micro_batch_size_per_gpu=None if dynamic else 4,
        use_dynamic_bsz=dynamic,
        ppo_max_token_len_per_gpu=40,
        fsdp_config=FSDPEngineConfig(strategy="fsdp2", mixed_precision=FP32, use_torch_compile=False),
        optim=FSDPOptimizerConfig(lr=lr, total_training_steps=4),
        grpo_parts={"attention": attention} if attention else {},
    )


def build_engine(model_dir: str, cfg: FSDPActorConfig, remove_padding: bool = True) -> FSDPEngineWithLMHead:
    model = HFModelConfig(
        path=model_dir, override_config={"attn_implementation": "sdpa"}, use_remove_padding=remove_padding
    )  # verl's default enable_gradient_checkpointing=True
    engine = FSDPEngineWithLMHead(model, cfg.engine, cfg.optim, CheckpointConfig())
    engine.initialize()
    return engine


def batch(meta, *, dynamic: bool, remove_padding: bool = True, seed: int = 1):
    """What verl's worker receives for ``meta`` (all stored fields) plus the PPO inputs of a step."""
    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id)
    assert "multi_modal_inputs" in data.keys()  # the v1 agent loop's {} per text sample
    n = int(data["responses"].offsets().numel()) - 1
    return with_ppo_inputs(
        data, dynamic=dynamic, remove_padding=remove_padding, seed=seed, micro_batch=4, global_batch=n
    )


def totals(metrics: dict) -> dict[str, float]:
    return {k: float(v.aggregate()) for k, v in metrics.items() if k.startswith("parts/")}


def full_params(engine) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in engine.module.named_parameters()}


@pytest.mark.parametrize(
    "dynamic,remove_padding",
    [(False, True), (True, True), (False, False)],
    ids=["fixed", "dynamic", "padded"],
)
def test_engine_on_equals_off(env, dynamic, remove_padding):
    model_dir, meta = env
    on_cfg, off_cfg = actor_config("shared_prefix", dynamic=dynamic), actor_config(None, dynamic=dynamic)
    on, off = (
        build_engine(model_dir, on_cfg, remove_padding),
        build_engine(model_dir, off_cfg, remove_padding),
    )

    with on.eval_mode():
        inf_on = on.infer_batch(batch(meta, dynamic=dynamic, remove_padding=remove_padding))
    with off.eval_mode():
        inf_off = off.infer_batch(batch(meta, dynamic=dynamic, remove_padding=remove_padding))
    data = batch(meta, dynamic=dynamic)
    for key in ("log_probs", "entropy"):
        ours = no_padding_2_padding(inf_on["model_output"][key], data)
        verl = no_padding_2_padding(inf_off["model_output"][key], data)
        torch.testing.assert_close(ours, verl, rtol=0, atol=2e-5)
    n_micro = len(inf_on["loss"])
    assert totals(inf_on["metrics"])["parts/attention/forwards"] == n_micro
    assert totals(inf_on["metrics"])["parts/attention/fallbacks"] == 0
    assert not any(k.startswith("parts/") for k in inf_off["metrics"])  # off: verl's forward, untouched

    before = full_params(off)
    with on.train_mode():
        tr_on = on.train_batch(
            batch(meta, dynamic=dynamic, remove_padding=remove_padding), partial(ppo_loss, config=on_cfg)
        )
    with off.train_mode():
        tr_off = off.train_batch(
            batch(meta, dynamic=dynamic, remove_padding=remove_padding), partial(ppo_loss, config=off_cfg)
        )
    torch.testing.assert_close(
        torch.tensor(tr_on["loss"]), torch.tensor(tr_off["loss"]), rtol=1e-5, atol=1e-6
    )
    assert tr_on["metrics"]["grad_norm"] == pytest.approx(tr_off["metrics"]["grad_norm"], rel=1e-4)
    after_on, after_off = full_params(on), full_params(off)
    moved = max(float((after_off[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-3  # the step did move the weights ...
    for k in after_on:  # ... the same way with and without the parts
        torch.testing.assert_close(after_on[k], after_off[k], rtol=0, atol=5e-5)
    t = totals(tr_on["metrics"])
    assert t["parts/attention/forwards"] == len(tr_on["loss"]) > 0 and t["parts/attention/fallbacks"] == 0
    assert t["parts/attention/logprob_forwards"] == n_micro and t["parts/attention/logprob_fallbacks"] == 0
    assert t["parts/attention/grid_tokens"] > 0 and t["parts/attention/packed_tokens"] > 0


def verl_config(model_dir: str, overrides: list[str]):
    """verl's own composed ``ppo_trainer`` config (the v1 trainer is the default) + ``overrides``."""
    import os

    import verl
    from hydra import compose, initialize_config_dir

    base = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        *[
            f"+actor_rollout_ref.{r}.fsdp_config.mixed_precision.{k}={v}"
            for r in ("actor", "ref")
            for k, v in FP32.items()
        ],
    ]
    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=base + overrides)
    assert cfg.trainer.use_v1  # verl's default trainer
    return cfg


def test_verl_workers_switched_on_by_config_keys(env):
    """verl's ``ActorRolloutRefWorker`` (actor and reference roles) built from the composed config:
    the override list alone switches the part on; log-probs written back to TransferQueue equal
    those of workers built without it, and the update reports the counters."""
    from verl.utils.metric import reduce_metrics
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import response_from_nested

    model_dir, _ = env
    meta = put_rollouts(rollouts(3, N, seed=5, prefix="w"), step=2)
    results = {}
    for name, overrides in {"off": [], "on": hydra_overrides("shared_prefix")}.items():
        cfg = verl_config(model_dir, overrides).actor_rollout_ref
        actor = ActorRolloutRefWorker(config=cfg, role="actor")
        actor.init_model()
        ref = ActorRolloutRefWorker(config=cfg, role="ref")
        ref.init_model()
        on = name == "on"
        assert (hook.options_of(actor.actor.engine.engine_config) is not None) is on
        assert (hook.options_of(ref.ref.engine.engine_config) is not None) is on
        info = {"calculate_entropy": True, "compute_loss": False, "temperature": 1.0}
        actor.compute_log_prob(with_info(meta, info))
        got = tq.kv_batch_get(
            keys=meta.keys, partition_id="train", select_fields=["log_probs", "entropy", "response_mask"]
        )
        ref.compute_ref_log_prob(with_info(meta, {**info, "calculate_entropy": False}))
        ref_lp = tq.kv_batch_get(keys=meta.keys, partition_id="train", select_fields=["log_probs"])[
            "log_probs"
        ]
        mask = got["response_mask"]
        results[name] = [response_from_nested(x, mask) for x in (got["log_probs"], got["entropy"], ref_lp)]
        # what the trainer writes back before the update (_compute_old_log_prob, _ref_log_prob, _advantage)
        g = torch.Generator().manual_seed(3)
        adv = [torch.randn(int(n), generator=g) for n in mask.offsets().diff()]
        fields = {
            "old_log_probs": results[name][0],
            "ref_log_prob": results[name][2],
            "advantages": torch.nested.nested_tensor(adv, layout=torch.jagged),
        }
        tq.kv_batch_put(keys=meta.keys, partition_id="train", fields=tu.get_tensordict(fields))
        train_info = {
            "calculate_entropy": False,
            "global_batch_size": 3 * N,
            "mini_batch_size": 3 * N,
            "epochs": 1,
            "seed": 0,
            "dataloader_kwargs": {"shuffle": False},
            "temperature": 1.0,
        }
        out = actor.update_actor(with_info(meta, train_info))
        results[name].append(reduce_metrics(dict(tu.get(out, "metrics"))))  # as the driver does
    *on, metrics_on = results["on"]
    *off, metrics_off = results["off"]
    for a, b in zip(on, off):  # old-policy log-probs, entropies, reference log-probs
        for x, y in zip(a.unbind(), b.unbind()):
            torch.testing.assert_close(x, y, rtol=0, atol=2e-5)
    assert metrics_on["parts/attention/forwards"] > 0 and metrics_on["parts/attention/fallbacks"] == 0
    assert metrics_on["parts/attention/logprob_forwards"] > 0
    assert metrics_on["parts/attention/logprob_fallbacks"] == 0
    assert not any(k.startswith("parts/") for k in metrics_off)
    assert metrics_on["loss"] == pytest.approx(metrics_off["loss"], rel=1e-5)


def test_critic_engine_is_never_patched(env, tmp_path):
    """A value-head engine in the same process runs verl's own forward (``values``), even with the
    dispatcher installed and options on its engine config."""
    from grpo_parts_adapters.verl.config import ENGINE_ATTR, EngineOptions
    from verl.workers.config import CriticConfig  # noqa: F401  (the critic's config class: no grpo_parts key)
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    model_dir, meta = env
    # the critic's engine class around the tiny LM: verl loads a real value model with
    # attn_implementation="flash_attention_2" hard-coded (load_valuehead_model), which CPUs lack
    model = HFModelConfig(path=model_dir, override_config={"attn_implementation": "sdpa"})
    eng_cfg = FSDPEngineConfig(
        strategy="fsdp2", mixed_precision=FP32, use_torch_compile=False, forward_only=True
    )
    setattr(eng_cfg, ENGINE_ATTR, EngineOptions(attention="shared_prefix"))
    critic = FSDPEngineWithValueHead(model, eng_cfg, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())
    critic.initialize()
    hook.install_engine_hook()
    before = hook.COUNTERS.total("attention") + hook.COUNTERS.total("attention", "fallbacks")
    with critic.eval_mode():
        hooked = critic.infer_batch(batch(meta, dynamic=False))
    assert hook.uninstall_engine_hook()
    with critic.eval_mode():
        plain = critic.infer_batch(batch(meta, dynamic=False))
    assert set(hooked["model_output"]) == {"values"}
    for x, y in zip(hooked["model_output"]["values"].unbind(), plain["model_output"]["values"].unbind()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert hook.COUNTERS.total("attention") + hook.COUNTERS.total("attention", "fallbacks") == before
    assert not any(k.startswith("parts/") for k in hooked["metrics"])


def test_gpu_smoke_first_batch_check_runs_on_cpu(env):
    """scripts/gpu/verl_gpu_smoke.py's first-batch check (verl's engine, parts on vs off) on CPU/FSDP2:
    the GPU run uses the same function with verl's default FSDP1."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "gpu" / "verl_gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("verl_gpu_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    result = smoke.first_batch_check(env[0], strategy="fsdp2")
    assert all(smoke.check_first_batch(result, 1e-4).values()), result
