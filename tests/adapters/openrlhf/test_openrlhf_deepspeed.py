"""OpenRLHF's own training step on CPU with a real DeepSpeed ZeRO-2 engine (one-rank gloo group).

The step runs in a subprocess (``_ds_worker.py``; what is real and what stands in is listed in
``_cpu_openrlhf.py``) because it creates a process group, starts Ray and answers OpenRLHF's CUDA
calls for CPU, none of which may leak into other tests. About 30 s.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("ray")
    out = tmp_path_factory.mktemp("openrlhf_ds")
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(out / "hf_datasets"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "_ds_worker.py"), str(out), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not (out / "results.pt").exists():
        pytest.fail(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    res = torch.load(out / "results.pt", weights_only=False)
    if res["errors"]:
        pytest.fail("\n\n".join(f"{k}:\n{v}" for k, v in res["errors"].items()))
    return res


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_deepspeed_step_with_parts_equals_without(results, packing):
    """Same CPPO-filtered experiences; OpenRLHF's make_experience, ActorPPOTrainer.ppo_train,
    DeepspeedStrategy.backward / optimizer_step on a ZeRO-2 engine: the grpo_parts policy actor
    (shared-prefix attention, grouped micro-batches) gives the old log-probs, the optimised
    objective and the updated parameters of OpenRLHF's own actor (float32)."""
    off, on = results["step"][packing, False, True], results["step"][packing, True, True]
    assert on["buffer_class"] == "GroupedReplayBuffer" and off["buffer_class"] == "NaiveReplayBuffer"
    assert off["kept"] == on["kept"] == 6  # CPPO kept half of 3 prompts x 4
    assert [p for p, _ in on["old_logprobs"]] == [p for p, _ in off["old_logprobs"]]
    for (_, a), (_, b) in zip(on["old_logprobs"], off["old_logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)
    assert on["micro_batches"] == off["micro_batches"] == 3  # one optimizer step (gas 3)
    assert math.isfinite(on["objective"]) and on["objective"] != 0
    assert on["objective"] == pytest.approx(off["objective"], abs=1e-6)
    assert on["status"]["actor_grad_norm"] == pytest.approx(off["status"]["actor_grad_norm"], rel=1e-5)
    moved = max((p - off["params_before"][n]).abs().max().item() for n, p in off["params"].items())
    assert moved > 1e-3  # the update moved the parameters well beyond the tolerance below
    for name, p in off["params"].items():
        torch.testing.assert_close(
            on["params"][name], p, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert on["counters"] == {"parts/attention/forwards": 5.0, "parts/attention/fallbacks": 0.0}


def test_logged_policy_loss_depends_on_micro_batch_composition(results):
    """OpenRLHF logs ``policy_loss`` as the token-weighted mean of per-micro-batch losses, each
    normalised by the whole step's tokens: a number that changes with which samples share a
    micro-batch. With grouped micro-batches off, the grpo_parts actor logs OpenRLHF's number."""
    off, ungrouped = results["step"][False, False, True], results["step"][False, True, False]
    assert ungrouped["buffer_class"] == "NaiveReplayBuffer"
    assert ungrouped["status"]["policy_loss"] == pytest.approx(off["status"]["policy_loss"], abs=1e-6)
    assert ungrouped["objective"] == pytest.approx(off["objective"], abs=1e-6)


def test_default_configuration_runs_every_part(results):
    """OpenRLHF's PPOTrainer.fit in its default configuration (CPU changes: see _ds_worker) with
    shared-prefix attention, CPPO + refill and the grpo_parts sampler (agent executor): every
    step's status dict says each part ran and none fell back."""
    run = results["default"]
    assert run["actor_class"] == "GRPOPartsActor" and run["buffer_class"] == "GroupedReplayBuffer"
    assert run["logged"], "no step was logged"
    for status in run["logged"]:
        assert status["parts/attention/forwards"] > 0 and status["parts/attention/fallbacks"] == 0
        assert status["parts/filter/calls"] >= 1 and status["parts/filter/fallbacks"] == 0
        assert status["parts/sampler/rollouts"] > 0 and status["parts/sampler/fallbacks"] == 0
        assert math.isfinite(status["policy_loss"])
    assert "generate_responses" in run["engine_calls"]
    assert {"forward", "append", "fit", "grpo_parts_counters"} <= set(run["actor_calls"])
    assert {"forward", "grpo_parts_counters"} <= set(run["ref_calls"])
