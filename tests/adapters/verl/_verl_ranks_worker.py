"""One rank of test_engine_ranks.py (``python _verl_ranks_worker.py OUT_DIR`` under multirank.run_ranks).

verl 0.9.1's real FSDP engine (``fsdp`` and ``fsdp2``) on a two-rank gloo group, verl's device
helpers pointed at CPU (``_cpu_verl.verl_on_cpu``). The ranks hold different data, as verl's
length balancing leaves them: rank 0 one ``uid`` group (4 short completions), rank 1 parts of three
groups with long-tailed completions. Per case (strategy, fixed/dynamic micro-batches, remove-padding
on/off; gradient checkpointing on, verl's default) two engines from the same weights, the
shared-prefix part on and off: ``infer_batch`` log-probs and entropies, then two ``train_batch``
updates (``ppo_loss``, AdamW): losses, grad norms and this rank's parameter shards after the updates.
The rows each rank's micro-batches were written with: verl's v1 agent-loop post-processing.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cpu_verl import put_rollouts, save_tiny_model, verl_on_cpu, with_ppo_inputs  # noqa: E402

N = 4
#: (strategy, dynamic micro-batch sizes, remove padding, grpo_parts options): the default options
#: let the backend plan each micro-batch; the forced ones split it into as many grids as it has
#: (sub-)groups
FORCED = (("chunk_overhead_tokens", -1),)
#: the padding-free layout forced, on its varlen cascade kernel and (``varlen=False``, the A/B
#: option) on the masked kernel
PADDING_FREE = (("layout", "padding_free"),)
CASES = [
    ("fsdp2", False, True, ()),
    ("fsdp2", True, True, ()),
    ("fsdp2", False, False, FORCED),
    ("fsdp", False, True, FORCED),
    ("fsdp", True, False, ()),
    ("fsdp2", False, True, PADDING_FREE),
    ("fsdp2", True, True, (*PADDING_FREE, ("varlen", False))),
]


def rank_rows(rank: int) -> list[tuple[str, list[int], list[int]]]:
    g = torch.Generator().manual_seed(100 + rank)

    def toks(k: int) -> list[int]:
        return torch.randint(4, 48, (k,), generator=g).tolist()

    if rank == 0:  # one group
        prompt = toks(6)
        return [("a", prompt, toks(k)) for k in (2, 4, 3, 5)]
    # parts of three groups: b long-tailed (cut into sub-groups, one call each: the padding bound),
    # c and d alike (one call, split into two grids when grids are forced)
    pb, pc, pd = toks(4), toks(8), toks(8)
    return [("b", pb, toks(1)), ("b", pb, toks(14)), ("c", pc, toks(5)), ("d", pd, toks(5))]


def rollout_data(rows: list[tuple[str, list[int], list[int]]]) -> Any:
    """The TensorDict verl's v1 agent loop writes for ``rows`` (captured instead of TransferQueue)."""
    import pytest
    import transfer_queue as tq
    import verl.trainer.ppo.v1.agent_loop_tq as alt
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    captured: list[dict[str, Any]] = []

    async def put(keys: Any, fields: Any, tags: Any, partition_id: Any) -> None:
        captured.extend(fields)

    mp = pytest.MonkeyPatch()
    mp.setattr(alt, "list_of_dict_to_tensordict", lambda fields: fields)
    mp.setattr(tq, "async_kv_batch_put", put)
    try:
        put_rollouts(rows)
    finally:
        mp.undo()
    # per-token fields are jagged in TransferQueue even when every row has the same length (the
    # stacking helper would make them dense)
    jagged = ("prompts", "responses", "response_mask", "loss_mask", "input_ids", "position_ids")
    for f in captured:
        f.update({k: _Jagged(f[k]) for k in jagged})
    data = list_of_dict_to_tensordict(captured)
    for k in jagged:
        data[k] = torch.nested.as_nested_tensor([f[k].t for f in captured], layout=torch.jagged)
    return data


class _Jagged:
    """Keeps the stacking helper from stacking a field (it stacks tensors only)."""

    def __init__(self, t: Any) -> None:
        self.t = t.t if isinstance(t, _Jagged) else torch.as_tensor(t)


def batch(rows: Any, *, dynamic: bool, remove_padding: bool, seed: int) -> Any:
    data = rollout_data(rows)
    n = int(data["responses"].offsets().numel()) - 1
    return with_ppo_inputs(
        data, dynamic=dynamic, remove_padding=remove_padding, seed=seed, micro_batch=2, global_batch=2 * n
    )


def actor_config(
    model_dir: str,
    strategy: str,
    options: dict[str, Any] | None,
    dynamic: bool,
    remove_padding: bool,
    *,
    mini_batch: int = 2,
    micro_batch: int = 2,
) -> Any:
    """verl's model config and the actor config (fp32 FSDP, AdamW) of the engines built here."""
    from grpo_parts_adapters.verl.config import FSDPActorConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    cfg = FSDPActorConfig(
        strategy=strategy,
        rollout_n=N,
        ppo_mini_batch_size=mini_batch,
        ppo_micro_batch_size_per_gpu=None if dynamic else micro_batch,
        use_dynamic_bsz=dynamic,
        ppo_max_token_len_per_gpu=40,
        fsdp_config=FSDPEngineConfig(strategy=strategy, mixed_precision=fp32, use_torch_compile=False),
        optim=FSDPOptimizerConfig(lr=1e-2, total_training_steps=4),
        grpo_parts=options or {},
    )
    model = HFModelConfig(
        path=model_dir, override_config={"attn_implementation": "sdpa"}, use_remove_padding=remove_padding
    )  # verl's default enable_gradient_checkpointing=True
    return model, cfg


def build(
    model_dir: str, strategy: str, options: dict[str, Any] | None, dynamic: bool, remove_padding: bool
) -> Any:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model, cfg = actor_config(model_dir, strategy, options, dynamic, remove_padding)
    engine = FSDPEngineWithLMHead(model, cfg.engine, cfg.optim, CheckpointConfig())
    engine.initialize()
    return engine, cfg


def shards(engine: Any) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in engine.module.named_parameters():
        v = v.to_local() if hasattr(v, "to_local") else v
        out[k] = v.detach().clone()
    return out


def response_part(x: Any, rows: list[tuple[str, list[int], list[int]]]) -> torch.Tensor:
    """The values at the positions that predict response tokens (verl's rolled layout), concatenated."""
    parts = x.unbind() if getattr(x, "is_nested", False) else list(x)
    out = []
    for t, (_, prompt, resp) in zip(parts, rows):
        n = len(prompt) + len(resp)
        out.append(t.reshape(-1)[n - len(resp) - 1 : n - 1])
    return torch.cat(out)


def totals(metrics: dict) -> dict[str, float]:
    return {k: float(v.aggregate()) for k, v in metrics.items() if k.startswith("parts/")}


def run_case(
    model_dir: str, rank: int, strategy: str, dynamic: bool, remove_padding: bool, options: tuple
) -> dict[str, Any]:
    from verl.workers.utils.losses import ppo_loss

    from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention

    rows = rank_rows(rank)
    plans: list[dict[str, Any]] = []
    original = SharedPrefixAttention.run

    def recording(self: Any, *a: Any, **k: Any) -> Any:
        out = original(self, *a, **k)
        plans.append(dict(self.last_plan))
        return out

    SharedPrefixAttention.run = recording  # type: ignore[method-assign]
    try:
        res: dict[str, Any] = {}
        on = {"attention": "shared_prefix", **dict(options)}
        engines = {name: build(model_dir, strategy, opts, dynamic, remove_padding)
                   for name, opts in (("on", on), ("off", None))}  # fmt: skip
        kw = {"dynamic": dynamic, "remove_padding": remove_padding}
        inf = {}
        for name, (engine, _) in engines.items():
            with engine.eval_mode():
                inf[name] = engine.infer_batch(batch(rows, seed=1, **kw))
        res["logprob_diff"] = max(
            float((response_part(inf["on"]["model_output"][k], rows)
                   - response_part(inf["off"]["model_output"][k], rows)).abs().max())
            for k in ("log_probs", "entropy")
        )  # fmt: skip
        res["infer_counters"] = totals(inf["on"]["metrics"])
        res["infer_micro"] = len(inf["on"]["loss"])
        res["before"] = shards(engines["off"][0])
        steps: dict[str, list[Any]] = {"on": [], "off": []}
        for step in range(2):
            for name, (engine, cfg) in engines.items():
                with engine.train_mode():
                    out = engine.train_batch(batch(rows, seed=2 + step, **kw), partial(ppo_loss, config=cfg))
                steps[name].append((out["loss"], out["metrics"]["grad_norm"], totals(out["metrics"])))
        res["steps"] = steps
        res["params"] = {name: shards(engine) for name, (engine, _) in engines.items()}
        res["plans"] = plans
        return res
    finally:
        SharedPrefixAttention.run = original  # type: ignore[method-assign]


def run_worker(cases: Any, run_case: Callable[..., dict[str, Any]]) -> None:
    """This rank's part of a launch: join the gloo group (rank 0 writes the tiny model), then
    ``run_case(model_dir, rank, *case)`` per case under ``verl_on_cpu``; saves ``OUT_DIR/rank{r}.pt``.
    A failing case exits at once (the other rank's next collective then fails too)."""
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model_dir = str(out / "model")
    if rank == 0:
        save_tiny_model(model_dir)
    dist.barrier()
    results: dict[str, Any] = {"cases": {}, "errors": {}}
    with verl_on_cpu():
        for case in cases:
            try:
                results["cases"][case] = run_case(model_dir, rank, *case)
            except Exception:
                results["errors"][str(case)] = traceback.format_exc()
                print(results["errors"][str(case)], flush=True)
                torch.save(results, out / f"rank{rank}.pt")
                os._exit(1)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_worker(CASES, run_case)
