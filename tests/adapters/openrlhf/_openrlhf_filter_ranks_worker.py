"""One rank of test_openrlhf_filter_ranks.py (``python _openrlhf_filter_ranks_worker.py OUT_DIR``
under multirank.run_ranks).

OpenRLHF's controller path on a two-rank gloo group with DeepSpeed ZeRO-2: the grpo_parts
experience maker filters the *global* rollout (every rank process plays the controller on the
same rollout, as OpenRLHF's single driver would), OpenRLHF's own ``RayActorGroup.async_run_method_batch``
cuts the experience list into the ranks' shares, and each rank runs the real
``PolicyModelActor.fit`` (``ppo_train``: a status all-reduce per micro-batch, DeepSpeed gradient
reduction, optimizer steps) on its share. The rollout's second half -- what plain OpenRLHF would
hand rank 1 -- is all zero-variance groups. Per case: kept rows, each rank's rows, micro-batches,
optimizer steps and filter counters.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _cpu_openrlhf import LocalGroup, fail_rank, make_strategy, setup_process  # noqa: E402

G, PROMPTS = 4, 4
#: prompts 0 and 1 have a signal; 2 and 3 (rows 8..15, plain OpenRLHF's share of rank 1) do not
REWARDS = [0.0, 1.0, 0.0, 1.0] + [0.0, 0.2, 0.9, 0.4] + [1.0] * 4 + [0.0] * 4
#: refill prompts: one with a signal, one without
REFILL = [0.0, 0.5, 1.0, 1.0] + [1.0] * 4
#: --train.batch_size 4 with micro-batches of 1 on 2 ranks: 2 micro-batches per optimizer step
TRAIN_BATCH = 4
#: name -> (filter, filter kwargs, rounding, refill rounds)
CASES: dict[str, tuple[str, dict[str, Any], str, int]] = {
    "zero_variance": ("zero_variance", {}, "up", 0),
    "cppo_up": ("cppo", {"k": 5}, "up", 0),
    "cppo_down": ("cppo", {"k": 7}, "down", 0),
    "cppo_refill": ("cppo", {"pruning_rate": 0.75}, "up", 1),
}


def args_for(filt: str, kwargs: dict[str, Any], rounding: str, refill: int) -> Any:
    import json

    from _ds_worker import parse

    argv = ["--actor.model_name_or_path", "unused", "--reward.remote_url", "unused.py",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(G),
            "--rollout.batch_size", str(PROMPTS), "--rollout.micro_batch_size", "3",
            "--train.batch_size", str(TRAIN_BATCH), "--train.micro_batch_size", "1",
            "--algo.kl.init_coef", "0", "--actor.num_gpus_per_node", os.environ["WORLD_SIZE"],
            "--vllm.num_engines", "1", "--actor.adam.lr", "0.01",
            "--grpo_parts.filter", filt, "--grpo_parts.filter_kwargs", json.dumps(kwargs),
            "--grpo_parts.kept_rounding", rounding, "--grpo_parts.refill_rounds", str(refill)]  # fmt: skip
    args = parse(argv)
    args.ds.param_dtype = "fp32"
    return args


class Dispatch:
    """OpenRLHF's ``RayActorGroup`` state that ``async_run_method_batch`` reads: one handler per rank
    that records the chunk it is sent (``ray.put`` is the identity here)."""

    def __init__(self, world: int):
        self.duplicate_actors = 1
        self.received: list[Any] = [None] * world
        self._actor_handlers = [
            SimpleNamespace(execute_batch=SimpleNamespace(remote=self._take(r))) for r in range(world)
        ]

    def _take(self, rank: int) -> Any:
        def remote(method: str, chunk: Any, start: int, end: int) -> None:
            self.received[rank] = chunk["experience"][start:end]

        return remote


class Refills:
    """The samples generator's refill entry point (``generate_prompts``) on a fixed stream."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def generate_prompts(self, num_prompts: int, before_wake: Any = None, **_: Any) -> list[Any]:
        from _openrlhf_helpers import rollout_samples

        self.calls.append(num_prompts)
        n = min(num_prompts, len(REFILL) // G)
        out = rollout_samples(torch.Generator().manual_seed(7), G, n, REFILL[: n * G], env_tokens=True)
        for s in out:
            s.rewards, s.scores = s.rewards.float(), s.scores.float()
            s.prompts = [f"refill {p}" for p in s.prompts]
        return out


def run_case(rank: int, world: int, policy: Any, name: str) -> dict[str, Any]:
    from _openrlhf_helpers import rollout_samples
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
    from openrlhf.trainer.ray.launcher import RayActorGroup

    args = args_for(*CASES[name])
    parts = OpenRLHFPartsConfig.from_args(args)
    refills = Refills()
    maker = GRPOPartsExperienceMaker(
        LocalGroup(policy), None, None, None, FixedKLController(0.0), policy.strategy,
        SimpleNamespace(pad_token_id=0), filter=parts.build_filter(),
        samples_generator=refills, refill_rounds=parts.refill_rounds, kept_rounding=parts.kept_rounding,
    )  # fmt: skip
    samples = rollout_samples(torch.Generator().manual_seed(1), G, PROMPTS, REWARDS, env_tokens=True)
    for s in samples:
        s.rewards, s.scores = s.rewards.float(), s.scores.float()
    experiences = maker.make_experience_batch(samples)  # the controller: filter, old log-probs
    kept = [(p, float(r)) for e in experiences for p, r in zip(e.prompts, e.rewards)]
    dispatch = Dispatch(world)
    RayActorGroup.async_run_method_batch(dispatch, "append", experience=experiences)  # OpenRLHF's cut
    mine = dispatch.received[rank]
    policy.execute_batch("append", {"experience": mine}, 0, len(mine))

    rows: list[int] = []
    original = policy.trainer.training_step

    def counting(experience: Any, *a: Any, **k: Any) -> Any:
        rows.append(len(experience.sequences))
        return original(experience, *a, **k)

    policy.trainer.training_step = counting
    engine = policy.actor.model
    steps_before = int(engine.global_steps)
    try:
        status = policy.fit(kl_ctl=0.0)
    finally:
        del policy.trainer.training_step
    return {
        "kept": kept,
        "share_rows": [sum(len(e.sequences) for e in share) for share in dispatch.received],
        "rows_trained": rows,
        "optimizer_steps": int(engine.global_steps) - steps_before,
        "filter_calls": maker.counters.total("filter"),
        "last_info": dict(maker.last_info),
        "refill_calls": refills.calls,
        "loss": float(status.get("policy_loss", float("nan"))),
    }


def main() -> None:
    import time

    t0 = time.monotonic()
    out = Path(sys.argv[1])
    setup_process(None)
    import ray
    import torch.distributed as dist
    from _ds_worker import policy_actor
    from _openrlhf_helpers import tiny_model

    ray.put = lambda x, *a, **k: x  # type: ignore[assignment]  # no object store: see the docstring
    ray.get = lambda x, *a, **k: x  # type: ignore[assignment]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"cases": {}, "errors": {}, "seconds": {"setup": time.monotonic() - t0}}
    # one DeepSpeed engine for every case (the cases differ only in grpo_parts flags)
    args = args_for(*CASES["cppo_up"])
    strategy = make_strategy(args)
    policy = policy_actor(args, strategy, tiny_model("qwen2", seed=0, dtype=torch.float32), False)
    results["seconds"]["engine"] = time.monotonic() - t0
    for name in CASES:
        try:
            t = time.monotonic()
            results["cases"][name] = run_case(rank, world, policy, name)
            results["seconds"][name] = time.monotonic() - t
        except Exception:
            fail_rank(results, name, out, rank)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
