"""OpenRLHF's own training step on CPU with a real DeepSpeed ZeRO-2 engine (one-rank gloo group).

The step runs in a subprocess (``_ds_worker.py``, started once by the package fixture ``cpu_run``
in conftest.py; what is real and what stands in is listed in ``_cpu_openrlhf.py``) because it
creates a process group, starts Ray and answers OpenRLHF's CUDA calls for CPU, none of which may
leak into other tests. About 30-40 s on 2 cores.
"""

from __future__ import annotations

import math

import pytest
import torch


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_deepspeed_step_with_parts_equals_without(cpu_run, packing):
    """Same CPPO-filtered experiences; OpenRLHF's make_experience, ActorPPOTrainer.ppo_train,
    DeepspeedStrategy.backward / optimizer_step on a ZeRO-2 engine: the grpo_parts policy actor
    (shared-prefix attention, grouped micro-batches) gives the old log-probs, the optimised
    objective and the updated parameters of OpenRLHF's own actor (float32)."""
    off, on = cpu_run["step"][packing, False, True], cpu_run["step"][packing, True, True]
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
    assert (
        on["counters"]["parts/attention/forwards"] == 5.0
        and on["counters"]["parts/attention/fallbacks"] == 0.0
    )
    assert (
        0 < on["counters"]["parts/attention/grid_tokens"] <= on["counters"]["parts/attention/packed_tokens"]
    )


def test_logged_policy_loss_depends_on_micro_batch_composition(cpu_run):
    """OpenRLHF logs ``policy_loss`` as the token-weighted mean of per-micro-batch losses, each
    normalised by the whole step's tokens: a number that changes with which samples share a
    micro-batch. With grouped micro-batches off, the grpo_parts actor logs OpenRLHF's number."""
    off, ungrouped = cpu_run["step"][False, False, True], cpu_run["step"][False, True, False]
    assert ungrouped["buffer_class"] == "NaiveReplayBuffer"
    assert ungrouped["status"]["policy_loss"] == pytest.approx(off["status"]["policy_loss"], abs=1e-6)
    assert ungrouped["objective"] == pytest.approx(off["objective"], abs=1e-6)


def test_default_configuration_runs_every_part(cpu_run):
    """OpenRLHF's PPOTrainer.fit in its default configuration (CPU changes: see _ds_worker) with
    shared-prefix attention, CPPO + refill and the grpo_parts sampler (agent executor): every
    step's status dict says each part ran and none fell back."""
    run = cpu_run["default"]
    assert run["actor_class"] == "GRPOPartsActor" and run["buffer_class"] == "GroupedReplayBuffer"
    assert run["logged"], "no step was logged"
    for status in run["logged"]:
        assert status["parts/attention/forwards"] > 0 and status["parts/attention/fallbacks"] == 0
        assert status["parts/filter/calls"] >= 1 and status["parts/filter/fallbacks"] == 0
        assert status["parts/sampler/rollouts"] > 0 and status["parts/sampler/fallbacks"] == 0
        assert math.isfinite(status["policy_loss"])
    first = [s for s in run["logged"] if "parts/attention/first_batch_logprob_max_abs_diff" in s]
    assert len(first) == 1  # checked on the first forward, reported once
    assert first[0]["parts/attention/first_batch_logprob_max_abs_diff"] < 0.05  # bf16 (OpenRLHF's default)
    assert "generate_responses" in run["engine_calls"]
    # the sampler followed OpenRLHF's own broadcast: once before the first rollout, once per step
    syncs = [s["parts/sampler/weight_syncs"] for s in run["logged"]]
    assert syncs == [float(k) for k in range(1, len(syncs) + 1)], syncs
    assert all(s["parts/sampler/frozen_rollouts"] == 0 for s in run["logged"])
    assert run["weight_state"]["syncs"] == len(syncs) + 1 and run["weight_state"]["stale"] is None
    assert run["sampler_max_diff"] == 0.0  # the executor's model is the trained actor's (bf16 values)
    assert {"init_process_group", "update_weight", "grpo_parts_mark_stale"} <= set(run["engine_calls"])
    assert {"forward", "append", "fit", "grpo_parts_counters"} <= set(run["actor_calls"])
    assert {"forward", "grpo_parts_counters"} <= set(run["ref_calls"])
