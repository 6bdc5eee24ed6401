"""One rank of test_wrapped_ranks.py: ``python _wrapped_ranks_worker.py OUT_DIR KIND[,KIND...]``
under multirank.run_ranks (two gloo processes on CPU).

For each KIND (``ddp``, ``fsdp1``, ``fsdp2``, ``accelerate``, ``zero2``) a float64 tiny Qwen2 is
wrapped as that framework wraps a policy and handed, *wrapped*, to the public API: the shared-prefix
and reference backends compute log-probs, entropies and a loss over two micro-batches (the first under
``no_sync`` where the wrapper has it), backward runs after each, and the gradients the wrapper leaves
(all-reduced / reduce-scattered over both ranks) are compared with the average of each rank's
single-process reference gradient, computed here on an unwrapped copy. The ranks hold batches of
different shapes: rank 0 one group per micro-batch (one long-tailed), rank 1 several groups split
into several grids, so rank 0 pads with empty calls. Then the reference sampler generates from the
wrapped policy with rank 0's rows finishing at the first token and rank 1's running on.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _attention_helpers import exact_norms  # noqa: E402
from _attention_ranks_worker import finish_rank, make_batch, start_rank  # noqa: E402

from grpo_parts.attention import LogprobBatch  # noqa: E402
from grpo_parts.attention.reference import RepeatedPrefixAttention  # noqa: E402
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention  # noqa: E402
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams  # noqa: E402
from grpo_parts.sampler.reference import ReferenceSampler  # noqa: E402
from grpo_parts.tiny import tiny_causal_lm  # noqa: E402
from grpo_parts.wrappers import generation_model, inner_model, wrapper_kind  # noqa: E402

#: rank -> its two micro-batches: (prompt length, completion lengths of its rows) per group
MICRO_BATCHES = {
    0: ([(5, [1, 1, 1, 12])], [(3, [2, 4])]),
    1: (
        [(4, [2]), (6, [2, 3, 1]), (3, [9]), (7, [5, 5])],
        [(2, [1, 3, 4, 2]), (5, [6]), (4, [3])],
    ),
}
BACKENDS = {
    "shared_prefix": lambda: SharedPrefixAttention(layout="grid", chunk_overhead_tokens=-1),
    "reference": RepeatedPrefixAttention,
}


def batches(rank: int) -> list[LogprobBatch]:
    return [make_batch(groups, seed=10 * rank + i) for i, groups in enumerate(MICRO_BATCHES[rank])]


def loss_of(out: Any) -> torch.Tensor:
    n = out.logprobs.shape[0]
    adv = torch.linspace(-1, 1, n, dtype=torch.float64)[:, None]
    return (out.logprobs * adv).sum() + 0.1 * out.entropies.sum()


def reference_grads(model: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    """The average over ranks of each rank's single-process gradient of its micro-batches' summed loss."""
    model.zero_grad(set_to_none=True)
    for r in range(world):
        for b in batches(r):
            loss_of(RepeatedPrefixAttention().completion_logprobs(model, b, compute_entropy=True)).backward()
    out = {n: p.grad.detach().clone() / world for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def wrap(kind: str, model: torch.nn.Module) -> Any:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer = type(model.model.layers[0])
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({layer}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if kind == "accelerate":
        from accelerate import Accelerator

        return Accelerator(cpu=True).prepare(model)
    if kind == "zero2":
        return deepspeed_engine(model)
    raise ValueError(kind)


def deepspeed_engine(model: torch.nn.Module) -> Any:
    """ZeRO-2 on CPU (as tests/adapters/openrlhf/_cpu_openrlhf.py runs it): torch's AdamW inside
    DeepSpeed, no shared-memory collectives; two micro-batches per step (``gradient_accumulation_steps``)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    return engine


@contextlib.contextmanager
def no_sync(kind: str, wrapped: Any) -> Iterator[None]:
    """Skip the gradient reduction of a micro-batch, as each framework spells it (ZeRO-2: the engine
    accumulates by itself; it refuses ``no_sync``)."""
    if kind == "fsdp2":
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    elif kind == "zero2":
        yield
    else:
        with wrapped.no_sync():
            yield


def full_grads(kind: str, wrapped: Any) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient, whole, by its inner-model name."""
    if kind == "zero2":
        from deepspeed.utils import safe_get_full_grad

        return {n: safe_get_full_grad(p).detach().clone() for n, p in wrapped.module.named_parameters()}
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.grad.detach().clone()
                for n, p in wrapped.named_parameters()
            }
    out = {}
    for n, p in inner_model(wrapped).named_parameters():
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def run_backend(kind: str, wrapped: Any, name: str, rank: int) -> dict[str, Any]:
    """Two micro-batches through the wrapped policy (the first without gradient sync): each one's
    old-policy (no grad) and training log-probs against the bare model's, the plan of each call."""
    res: dict[str, Any] = {"plans": [], "logprobs": [], "entropies": []}
    for i, b in enumerate(batches(rank)):
        backend = BACKENDS[name]()
        with torch.no_grad():
            res["logprobs"].append(backend.completion_logprobs(wrapped, b).logprobs)
        with no_sync(kind, wrapped) if i == 0 else contextlib.nullcontext():
            out = backend.completion_logprobs(wrapped, b, compute_entropy=True)
            res["plans"].append(dict(getattr(backend, "last_plan", {})))
            res["logprobs"].append(out.logprobs.detach())
            res["entropies"].append(out.entropies.detach())
            if kind == "zero2":  # the engine scales by 1 / gradient_accumulation_steps
                wrapped.backward(loss_of(out))
                if i == 0:
                    wrapped.step()  # not a boundary: counts the micro-step, reduces nothing yet
            else:
                loss_of(out).backward()
    res["grads"] = full_grads(kind, wrapped)  # (no step: ZeRO's would round the weights to float32)
    return res


def run_sampler(wrapped: Any, bare: torch.nn.Module, rank: int) -> dict[str, Any]:
    """The reference sampler on the wrapped policy == on the bare model (same generator). Rank 0's
    rows end at their first token (every token is an EOS), rank 1's run all 6 steps."""
    g = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(1, 32, (2, 4), generator=g)
    prompts = PromptBatch(ids, torch.ones_like(ids))
    eos = tuple(range(32)) if rank == 0 else ()
    params = SamplingParams(group_size=2, max_new_tokens=6, temperature=1.0, eos_token_ids=eos)
    calls: list[int] = []
    model, lockstep = generation_model(wrapped)
    hook = inner_model(wrapped).register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    got = ReferenceSampler(wrapped).generate(prompts, params, torch.Generator().manual_seed(3))
    hook.remove()
    want = ReferenceSampler(bare).generate(prompts, params, torch.Generator().manual_seed(3))
    return {
        "forwards": len(calls),
        "lockstep": lockstep,
        "calls_wrapper": model is not inner_model(wrapped),
        "completion_equal": bool(torch.equal(got.completion_ids, want.completion_ids)),
        "logprob_diff": float((got.logprobs - want.logprobs).abs().max()),
        "steps": int(got.completion_ids.shape[1]),
    }


def run_kind(kind: str, rank: int, world: int) -> dict[str, Any]:
    base = exact_norms(tiny_causal_lm("qwen2", vocab_size=32, num_kv_heads=2, dtype=torch.float64, seed=0))
    base.train()
    bare = copy.deepcopy(base)
    expected = reference_grads(bare, world)
    out: dict[str, Any] = {}
    for name in BACKENDS:
        wrapped = wrap(kind, copy.deepcopy(base))  # a fresh wrapper (and optimizer) per backend
        out["wrapper"] = wrapper_kind(wrapped) or type(wrapped).__name__
        res = run_backend(kind, wrapped, name, rank)
        want = [
            RepeatedPrefixAttention().completion_logprobs(bare, b, compute_entropy=True)
            for b in batches(rank)
        ]
        with torch.no_grad():
            ref_lp = [o.logprobs for o in want for _ in (0, 1)]
            res["logprob_diff"] = max(float((a - b).abs().max()) for a, b in zip(res.pop("logprobs"), ref_lp))
            res["entropy_diff"] = max(
                float((a - o.entropies).abs().max()) for a, o in zip(res.pop("entropies"), want)
            )
        grads = res.pop("grads")
        scale = 0.5 if kind == "zero2" else 1.0  # DeepSpeed averages over its 2 micro-batches too
        res["grad_diff"] = max(float((grads[n] - scale * g).abs().max()) for n, g in expected.items())
        res["grad_norm"] = max(float(g.double().norm()) for g in expected.values())
        res["missing_grads"] = sorted(set(expected) - set(grads))
        out[name] = res
    out["sampler"] = run_sampler(wrapped, bare, rank)
    return out


def main() -> None:
    out_dir, kinds = Path(sys.argv[1]), sys.argv[2].split(",")
    rank, world = start_rank()
    finish_rank({kind: run_kind(kind, rank, world) for kind in kinds}, out_dir)


if __name__ == "__main__":
    main()
