"""One rank of test_trl_ranks.py (``python _trl_ranks_worker.py OUT_DIR CASE...`` under multirank.run_ranks).

TRL's real ``GRPOTrainer.train()`` under accelerate on a two-rank gloo group (CPU), DeepSpeed ZeRO-2 /
ZeRO-3 or plain DDP, with gradient accumulation 2: stock TRL vs ``GRPOPartsTrainer`` with the
shared-prefix backend. Completions are scripted (as in test_trl_vs_stock.py), so both runs see the
same rows; TRL deals each rank other prompts, so the ranks hold different shapes. Per run: the full
gradient of every parameter at each optimizer step, the logged losses and grad norms, every
parameter after training and the part counters.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

G = 4


def _scripted(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Fixed completions of 1-4 tokens and EOS (1), drawn from the prompt (so each rank differs);
    on rank 0 the first prompt's completions are truncated (5 tokens, no EOS): with
    ``mask_truncated_completions`` that group has no loss token, so rank 0 has a micro-batch with no
    completion to score while rank 1 has none such, and fewer live rows to score without grad."""
    first = torch.distributed.get_rank() == 0
    out = []
    for i, p in enumerate(prompt_ids):
        n = 5 if first and i < G else 1 + (sum(p) + 3 * (i % G)) % 4
        toks = [3 + (sum(p) * 7 + 5 * i + 3 * k) % 26 for k in range(n)]
        out.append(toks if n == 5 else toks + [1])
    return out


def _classes() -> tuple[type, type]:
    from grpo_parts_adapters.trl import GRPOPartsTrainer
    from trl import GRPOTrainer

    class Stock(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *a, **k):  # type: ignore[no-untyped-def]
            return _scripted(prompt_ids), None

    class Parts(GRPOPartsTrainer):
        shapes: list[tuple[bool, tuple[int, ...]]] = []  # (grad, input_ids.shape) of each attention call

        def _generate_single_turn(self, prompt_ids, *a, **k):  # type: ignore[no-untyped-def]
            return _scripted(prompt_ids), None

        def _get_per_token_logps_and_entropies(self, model, input_ids, *a, **k):  # type: ignore[no-untyped-def]
            self.shapes.append((torch.is_grad_enabled(), tuple(input_ids.shape)))
            return super()._get_per_token_logps_and_entropies(model, input_ids, *a, **k)

    return Stock, Parts


def _ds_config(stage: int) -> dict[str, Any]:
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,  # the Trainer's torch SGD
    }


def _state(case: str) -> None:
    """accelerate's state for ``case``: DeepSpeed on CPU needs a gloo PartialState set up here
    (TrainingArguments gives DeepSpeed no backend off CUDA); DDP is accelerate's MULTI_CPU."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    if case == "ddp":
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        return
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def _full_grads(engine: Any) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(case: str, parts_on: bool, base: torch.nn.Module, ref_path: str) -> dict[str, Any]:
    """One ``train()``: 2 optimizer steps of 2 accumulated micro-batches each, on one generation
    (``num_iterations=2``: TRL scores old-policy log-probs), KL to a reference model (``beta``: under
    DeepSpeed TRL wraps the reference model in an engine of its own)."""
    import trl_tiny as tiny
    from transformers import TrainerCallback, set_seed

    _state(case)
    grads: list[dict[str, torch.Tensor]] = []

    class Capture(TrainerCallback):  # DDP: p.grad is the full (all-reduced, clipped) gradient here
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):  # type: ignore[no-untyped-def]
            if case == "ddp":
                grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    extra: dict[str, Any] = {}
    if case != "ddp":
        extra = {"deepspeed": _ds_config(int(case[-1])), "accelerator_config": {"use_configured_state": True}}
    args = tiny.config(
        gradient_accumulation_steps=2,
        num_iterations=2,
        beta=0.1,
        mask_truncated_completions=True,
        max_steps=2,
        optim="sgd",
        use_cpu=case == "ddp",
        ddp_backend="gloo",
        **extra,
    )
    stock_cls, parts_cls = _classes()
    policy = copy.deepcopy(base)
    policy.config._name_or_path = ref_path  # TRL loads the reference model from here
    set_seed(0)
    trainer = (parts_cls if parts_on else stock_cls)(
        model=policy,
        reward_funcs=tiny.reward,
        args=args,
        train_dataset=tiny.dataset(8),
        processing_class=tiny.tokenizer(),
        callbacks=[Capture()],
        **({"attention": "shared_prefix"} if parts_on else {}),
    )
    calls: list[tuple[int, int]] = []  # completion_ids.shape of each backend call
    if parts_on:
        backend, served = trainer.gp_attention, trainer.gp_attention.completion_logprobs

        def counting(model: Any, batch: Any, **kw: Any) -> Any:
            calls.append(tuple(batch.completion_ids.shape))
            return served(model, batch, **kw)

        backend.completion_logprobs = counting
    if case != "ddp":  # the full gradient at each accumulation boundary, before DeepSpeed's step
        from deepspeed.runtime.engine import DeepSpeedEngine

        step = DeepSpeedEngine.step

        def recording(engine: Any, *a: Any, **k: Any) -> Any:
            if engine.is_gradient_accumulation_boundary() and engine is trainer.model_wrapped:
                grads.append(_full_grads(engine))
            return step(engine, *a, **k)

        DeepSpeedEngine.step = recording  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        if case != "ddp":
            DeepSpeedEngine.step = step  # type: ignore[method-assign]
    return {
        "grads": grads,
        "logs": [dict(x) for x in trainer.state.log_history],
        "params": _full_params(trainer.accelerator.unwrap_model(trainer.model)),
        "wrapped": type(trainer.model_wrapped).__name__,
        "ref": type(trainer.ref_model).__name__,
        "shapes": list(getattr(trainer, "shapes", [])),
        "calls": calls,
        "reasons": dict(trainer._gp_counters.reasons) if parts_on else {},
    }


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    import deepspeed
    import deepspeed.ops
    import trl_tiny as tiny

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    base = tiny.model(dtype=torch.float32)
    ref_path = str(out / "ref")
    if rank == 0:
        base.save_pretrained(ref_path)
    torch.distributed.barrier()
    results: dict[str, Any] = {"runs": {}, "errors": {}}
    for case in cases:
        for parts_on in (False, True):
            try:
                results["runs"][case, parts_on] = run(case, parts_on, base, ref_path)
            except Exception:
                results["errors"][f"{case} parts_on={parts_on}"] = traceback.format_exc()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
