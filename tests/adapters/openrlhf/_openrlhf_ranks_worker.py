"""One rank of test_openrlhf_ranks.py (``python _openrlhf_ranks_worker.py OUT_DIR`` under multirank.run_ranks).

OpenRLHF's real step (``make_experience``, ``PolicyModelActor.append/fit``, ``ActorPPOTrainer``,
``DeepspeedStrategy`` on a DeepSpeed ZeRO-2 or ZeRO-3 engine) on a two-rank gloo group, each rank
with its own share of the experiences as OpenRLHF's trainer hands them to its actor ranks: rank 0's
CPPO-kept rows are one prompt group, rank 1's come from two groups with other lengths. Per case
(ZeRO stage, packing) the grpo_parts actor (shared prefix, grouped micro-batches, grids split as far
as the groups allow so rank 0 pads with empty calls) and OpenRLHF's own actor run the same step:
old log-probs, objective, grad norm, full parameters after the update, counters and plans.
Ray's object store is not started here: ``ray.put``/``ray.get`` are the identity (the model actors
live in this process, see ``_cpu_openrlhf.LocalGroup``).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _cpu_openrlhf import fail_rank, make_strategy, setup_process  # noqa: E402

G = 4
#: per rank, two prompts x G: rank 0's second group has zero variance (CPPO keeps only the first)
REWARDS = {0: [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 1: [0.0, 1.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.4]}
#: (ZeRO stage, packing)
CASES = [(2, False), (2, True), (3, False), (3, True)]


def full_params(policy: Any) -> dict[str, torch.Tensor]:
    import deepspeed

    from grpo_parts.wrappers import transformers_model as hf_model

    model = hf_model(policy.actor.model)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def record_grads(policy: Any) -> list[dict[str, torch.Tensor]]:
    """Each update's full gradient per parameter, read at the accumulation boundary just before
    DeepSpeed's optimizer step (``safe_get_full_grad``: ZeRO-3 holds only a partition per rank)."""
    from deepspeed.utils import safe_get_full_grad

    from grpo_parts.wrappers import transformers_model as hf_model

    engine, grads = policy.actor.model, []
    step = engine.step

    def recording(*a: Any, **k: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():
            named = hf_model(engine).named_parameters()
            grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in named})
        return step(*a, **k)

    engine.step = recording
    return grads


def step(rank: int, stage: int, packing: bool, parts_on: bool) -> dict[str, Any]:
    from _ds_worker import policy_actor, recording_maker, step_args
    from _openrlhf_helpers import rollout_samples, tiny_model

    from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention

    args = step_args(packing, parts_on, True)
    args.ds.zero_stage = stage
    args.train.batch_size = 4 * int(
        os.environ["WORLD_SIZE"]
    )  # 4 kept rows per rank, micro-batches of 2: 2 per rank per step
    args.rollout.batch_size = 2
    args.train.max_epochs = 2  # two updates on the same experiences (the second one off-policy)
    strategy = make_strategy(args)
    policy = policy_actor(args, strategy, tiny_model("qwen2", seed=0, dtype=torch.float32), parts_on)
    plans: list[dict[str, Any]] = []
    if parts_on:
        backend = policy.actor.grpo_backend
        backend.chunk_overhead_tokens = -1  # as many grids as a call has groups
        original = backend.run

        def recording(*a: Any, **k: Any) -> Any:
            out = original(*a, **k)
            plans.append(dict(backend.last_plan))
            return out

        backend.run = recording
        assert isinstance(backend, SharedPrefixAttention)
    group, maker, losses = recording_maker(policy, args, strategy)
    # this process plays the controller for its own rank only: its kept rows are rounded to one
    # rank's share of --train.batch_size (4), not to the global batch
    maker.args = copy.deepcopy(args)
    maker.args.train.batch_size = 4
    samples = rollout_samples(torch.Generator().manual_seed(1 + rank), G, 2, REWARDS[rank], env_tokens=True)
    for s in samples:
        s.rewards, s.scores = s.rewards.float(), s.scores.float()
    experiences = maker.make_experience_batch(samples)
    old = [
        (p, lp[m].tolist())
        for e in experiences
        for p, lp, m in zip(e.prompts, e.action_log_probs, e.action_mask)
    ]
    group.async_run_method_batch("append", experience=experiences)
    before, grads = full_params(policy), record_grads(policy)
    torch.manual_seed(0)
    status = group.async_run_method("fit", kl_ctl=0.0)[0]
    return {"old_logprobs": old, "status": status, "params": full_params(policy), "params_before": before,
            "grads": grads, "counters": policy.grpo_parts_counters() if parts_on else {}, "plans": plans,
            "kept_prompts": sorted({p for p, _ in old}), "micro_batches": len(losses),
            "objective": float(sum(losses) / strategy.accumulated_gradient)}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    setup_process(None)
    import ray
    import torch.distributed as dist

    ray.put = lambda x, *a, **k: x  # type: ignore[assignment]  # no object store: see the docstring
    ray.get = lambda x, *a, **k: x  # type: ignore[assignment]
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"step": {}, "errors": {}}
    for stage, packing in CASES:
        for parts_on in (True, False):
            try:
                results["step"][stage, packing, parts_on] = step(rank, stage, packing, parts_on)
            except Exception:
                fail_rank(results, f"{stage=} {packing=} {parts_on=}", out, rank)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
