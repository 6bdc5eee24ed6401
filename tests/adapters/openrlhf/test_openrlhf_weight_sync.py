"""The agent executor's sampler follows OpenRLHF's own weight broadcast (issue 42).

The first test runs OpenRLHF 0.11.2's ``ActorPPOTrainer._init_vllm_sync_group`` and
``broadcast_to_vllm`` as shipped into the launcher's rollout actor (``RolloutParts``), over gloo
on CPU, in a subprocess (``_weight_sync_worker.py``: a process group and CUDA stand-ins must not
leak into other tests; ~20 s). The trainer's side (a broadcast before the first rollout, copies
marked stale before each update) runs inside OpenRLHF's ``PPOTrainer.fit`` in
test_openrlhf_deepspeed.py. The others are in-process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from _openrlhf_helpers import char_tokenizer, tiny_model
from conftest import run_worker

from grpo_parts.errors import GRPOPartsError


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: Any) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("openrlhf_weight_sync")
    res, _ = run_worker("_weight_sync_worker.py", out)
    if res["error"]:
        pytest.fail(res["error"])
    return dict(res["run"])


def test_openrlhf_broadcast_reaches_the_executors_sampler(sync_run):
    """After each OpenRLHF broadcast the sampler's weights are the actor's (bf16 values, exactly);
    before the first one, and after the trainer marks the copy stale, a rollout is refused."""
    r = sync_run
    assert r["refused_before_sync"].startswith("StaleWeightsError: ")
    assert "has not received the actor's weights" in r["refused_before_sync"]
    assert r["before_first"] > 0.01  # the actor moved away from the checkpoint the sampler loaded
    for step, key in ((1, "first"), (2, "second")):
        assert r[key]["max_diff"] == 0.0
        assert r[key]["state"]["stale"] is None and r[key]["state"]["syncs"] == step
        assert r[key]["extra_logs"]["parts/sampler/weight_syncs"] == float(step)
        assert r[key]["extra_logs"]["parts/sampler/frozen_rollouts"] == 0.0
    assert r["refused_after_mark"].startswith("StaleWeightsError: ") and "(step 2)" in r["refused_after_mark"]
    assert r["engine_calls"] == ["init_process_group", "update_weight"]  # OpenRLHF's calls, nothing else


# ---------------------------------------------------------------------------------- in-process


def executor(**kwargs: Any) -> Any:
    from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor

    from grpo_parts.sampler import get_sampler_class

    model = tiny_model("qwen2", dtype=torch.float32)
    return GRPOPartsAgentExecutor(lambda: get_sampler_class("reference")(model), seed=0, **kwargs)


def rollout(ex: Any, n: int = 2) -> list[dict[str, Any]]:
    import vllm

    sp = vllm.SamplingParams(temperature=1.0, max_tokens=4)

    async def main() -> list[dict[str, Any]]:
        return await asyncio.gather(*[ex.execute("4+4=", "8", sp, 24, char_tokenizer()) for _ in range(n)])

    return asyncio.run(main())


def test_rollout_without_sync_is_refused_in_one_line():
    from grpo_parts.doors.policy_copy import StaleWeightsError

    ex = executor()
    with pytest.raises(StaleWeightsError) as e:
        rollout(ex)
    msg = str(e.value)
    assert "\n" not in msg and "refusing a training rollout" in msg
    assert "python -m grpo_parts_adapters.openrlhf.launch" in msg and "allow_frozen" in msg
    assert ex.generate_calls == 0


def test_allow_frozen_counts_frozen_rollouts():
    ex = executor(allow_frozen=True)
    for k in (1, 2):
        logs = rollout(ex)[0]["extra_logs"]
        assert logs["parts/sampler/frozen_rollouts"] == float(k)
        assert logs["parts/sampler/weight_syncs"] == 0.0
    assert ex.policy_copy.counters() == {"weight_syncs": 0.0, "frozen_rollouts": 2.0}


def test_sync_weights_copies_into_the_samplers_model():
    ex = executor()
    trained = tiny_model("qwen2", seed=7, dtype=torch.float32)
    ex.sync_weights(trained)
    mine = dict(ex.policy_copy.model.named_parameters())
    for name, p in trained.named_parameters():
        assert torch.equal(mine[name], p) and mine[name] is not p  # copied in place, not swapped
    logs = rollout(ex)[0]["extra_logs"]
    assert logs["parts/sampler/weight_syncs"] == 1.0 and logs["parts/sampler/frozen_rollouts"] == 0.0


class _QueueGroup:
    """A sync group whose ``broadcast`` hands out the sender's tensors in order."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = list(tensors)

    def broadcast(self, weight: torch.Tensor, src: int, stream: Any = None) -> None:
        weight.copy_(self.tensors.pop(0))


def test_receiver_loads_only_a_whole_broadcast(monkeypatch):
    """A broadcast that stops half-way leaves the copy stale (refused), not half-loaded."""
    from grpo_parts_adapters.openrlhf.rollout import WeightReceiver

    from grpo_parts.doors.policy_copy import StaleWeightsError

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)  # PyNccl's stream argument
    ex = executor()
    trained = tiny_model("qwen2", seed=3, dtype=torch.float32)
    params = list(trained.named_parameters())
    rx = WeightReceiver(ex)
    rx.group = _QueueGroup([p.detach().to(torch.bfloat16) for _, p in params])
    before = {n: p.detach().clone() for n, p in ex.policy_copy.model.named_parameters()}
    for name, p in params[:-1]:
        rx.receive(name, torch.bfloat16, p.shape, last=False)
    with pytest.raises(StaleWeightsError, match="broadcast started and has not finished"):
        rollout(ex)
    assert all(torch.equal(p, before[n]) for n, p in ex.policy_copy.model.named_parameters())
    name, p = params[-1]
    rx.receive(name, torch.bfloat16, p.shape, last=True)
    mine = dict(ex.policy_copy.model.named_parameters())
    assert all(torch.equal(mine[n], q.detach().to(torch.bfloat16).float()) for n, q in params)
    assert rollout(ex)[0]["extra_logs"]["parts/sampler/weight_syncs"] == 1.0


def write_agent(tmp: Path) -> Path:
    model: Any = tiny_model("qwen2", dtype=torch.float32)
    model.save_pretrained(tmp / "model")
    path = tmp / "agent.py"
    path.write_text(f"""from transformers import AutoModelForCausalLM
from grpo_parts.sampler import get_sampler_class
from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor


class AgentExecutor(GRPOPartsAgentExecutor):
    def __init__(self):
        super().__init__(lambda: get_sampler_class("reference")(AutoModelForCausalLM.from_pretrained({str(tmp / "model")!r})))
""")
    return path


def test_rollout_actor_takes_the_broadcast_for_a_grpo_parts_executor(tmp_path):
    """Built from the agent file as OpenRLHF builds its engine: no vLLM, the worker's rank is its
    own; tensor parallelism (several worker ranks) is refused in one line."""
    from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor
    from grpo_parts_adapters.openrlhf.rollout import RolloutParts

    agent = str(write_agent(tmp_path))
    actor = RolloutParts.__new__(RolloutParts)
    asyncio.run(
        actor.__init__(agent_func_path=agent, tensor_parallel_size=1, num_gpus=1, bundle_indices=None)
    )
    assert isinstance(actor.executor, GRPOPartsAgentExecutor) and actor.llm is None
    assert actor.grpo_parts_receives_weights() and actor.get_num_unfinished_requests() == 0
    assert actor.grpo_parts_weight_state()["stale"] is not None
    with pytest.raises(GRPOPartsError, match="no vLLM engine"):
        asyncio.run(actor.generate([1, 2], None))
    tp2 = RolloutParts.__new__(RolloutParts)
    with pytest.raises(GRPOPartsError, match="--vllm.tensor_parallel_size 2") as e:
        asyncio.run(tp2.__init__(agent_func_path=agent, tensor_parallel_size=2, num_gpus=1))
    assert "\n" not in str(e.value)


def test_create_vllm_engines_builds_the_rollout_actor_for_an_agent_file():
    """OpenRLHF's create_vllm_engines builds the launcher's class for an agent file, its own kwargs
    intact (without one: OpenRLHF's RolloutRayActor, test_openrlhf_launch.py)."""
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.openrlhf.rollout import GRPOPartsRolloutActor
    from grpo_parts_adapters.openrlhf.vllm_spec import create_vllm_engines_with
    from openrlhf.trainer.ray import vllm_engine

    created: list[tuple[str, dict]] = []

    class Fake:
        def __init__(self, name: str):
            self.name = name

        def options(self, **options: Any) -> Any:
            return self

        def remote(self, **kwargs: Any) -> Any:
            created.append((self.name, kwargs))
            return object()

    create = create_vllm_engines_with(OpenRLHFPartsConfig(), rollout_class=Fake("parts"))
    create(1, 1, "some/model", 0, False, False, True, 256, shared_pg=object(), agent_func_path="agent.py")
    assert created[0][0] == "parts" and created[0][1]["agent_func_path"] == "agent.py"
    assert created[0][1]["model"] == "some/model" and created[0][1]["max_model_len"] == 256
    assert (
        GRPOPartsRolloutActor.__ray_metadata__.modified_class.__ray_actor_class__.__name__ == "RolloutParts"
    )
    assert vllm_engine.RolloutRayActor is not GRPOPartsRolloutActor  # OpenRLHF's module untouched
