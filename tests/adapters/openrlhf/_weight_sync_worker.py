"""Subprocess for test_openrlhf_weight_sync.py: OpenRLHF 0.11.2's own weight sync into the
launcher's rollout actor, on CPU (what is real and what stands in: _cpu_openrlhf.py).

``python _weight_sync_worker.py OUT_DIR PORT`` writes ``OUT_DIR/results.pt``. The rollout actor
(``RolloutParts``, the class ``create_vllm_engines`` builds under the launcher) loads the agent
file as OpenRLHF does (a ``GRPOPartsAgentExecutor`` on a reference sampler over the checkpoint,
``allow_frozen`` left off). The actor side is OpenRLHF's ``ActorPPOTrainer``: its
``_init_vllm_sync_group`` and ``broadcast_to_vllm`` run as shipped, on a bf16 copy of the policy
(OpenRLHF's default parameter dtype) standing where DeepSpeed's engine keeps it (``.module``).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _cpu_openrlhf import LocalEngine, broadcast, init_sync_group, setup_process  # noqa: E402


def max_diff(sampler_model: torch.nn.Module, actor_model: torch.nn.Module) -> float:
    mine = dict(sampler_model.named_parameters())
    return max((mine[n].float() - p.float()).abs().max().item() for n, p in actor_model.named_parameters())


def update(model: torch.nn.Module, seed: int) -> None:
    """Stands in for an optimizer step: every parameter moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.05 * torch.randn(p.shape, generator=g)).to(p.dtype))


def rollout(engine: LocalEngine) -> Any:
    """OpenRLHF's ``generate_responses`` on the engine (4 samples of one prompt): the responses,
    or the error it raised as a string."""
    from _openrlhf_helpers import char_tokenizer

    sp = sys.modules["vllm"].SamplingParams(temperature=1.0, max_tokens=4)
    call = engine.actor.generate_responses(
        prompt="12+3=",
        label="15",
        sampling_params=sp,
        max_length=24,
        hf_tokenizer=char_tokenizer(),
        num_samples=4,
    )
    try:
        return engine.run(call).result(timeout=300)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def snapshot(engine: LocalEngine, actor_model: torch.nn.Module) -> dict[str, Any]:
    out = rollout(engine)
    return {
        "max_diff": max_diff(engine.executor.policy_copy.model, actor_model),
        "state": engine.actor.grpo_parts_weight_state(),
        "extra_logs": out if isinstance(out, str) else out[0]["extra_logs"],
    }


def run(tmp: Path) -> dict[str, Any]:
    from _ds_worker import parse, write_default_run
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from transformers import AutoModelForCausalLM

    args = parse(write_default_run(tmp))  # the launcher's parser: --vllm.num_engines 1, sync over gloo
    engine = LocalEngine(args.train.agent_func_path)
    res: dict[str, Any] = {"refused_before_sync": rollout(engine)}

    actor_model = AutoModelForCausalLM.from_pretrained(tmp / "model", torch_dtype=torch.bfloat16)
    trainer = ActorPPOTrainer.__new__(ActorPPOTrainer)
    trainer.strategy, trainer.args = SimpleNamespace(args=args), args
    trainer.actor = SimpleNamespace(model=SimpleNamespace(module=actor_model))  # DeepSpeed engine's .module
    init_sync_group(trainer, [engine])

    update(actor_model, seed=1)
    res["before_first"] = max_diff(engine.executor.policy_copy.model, actor_model)
    broadcast(trainer)
    res["first"] = snapshot(engine, actor_model)

    engine.actor.grpo_parts_mark_stale("the actor is being updated (step 2)")  # what the trainer does
    res["refused_after_mark"] = rollout(engine)
    update(actor_model, seed=2)
    broadcast(trainer)
    res["second"] = snapshot(engine, actor_model)
    res["engine_calls"] = sorted(set(engine.calls))
    return res


def main() -> None:
    out, port = Path(sys.argv[1]), int(sys.argv[2])
    setup_process(port)
    try:
        results: dict[str, Any] = {"run": run(out), "error": None}
    except Exception:
        results = {"run": None, "error": traceback.format_exc()}
    torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main()
