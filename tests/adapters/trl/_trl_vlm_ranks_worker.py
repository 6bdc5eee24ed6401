"""One rank of test_trl_vlm_ranks.py (``python _trl_vlm_ranks_worker.py OUT_DIR`` under
multirank.run_ranks): TRL's real ``GRPOTrainer.train()`` under accelerate's DDP on a two-rank gloo
group, a tiny float32 Qwen2-VL, its processor and an image dataset; TRL deals each rank other
prompts and images (other widths and patch counts). Three runs: stock TRL and ``GRPOPartsTrainer``
with the shared-prefix backend, both on the text ranks test's scripted completions
(``_trl_ranks_worker._classes``: the same rows), for their gradients;
then every part on (reference sampler, shared prefix, CPPO) for its counters.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def run(kind: str) -> dict[str, Any]:
    """``kind``: ``stock`` / ``attention`` (scripted completions) / ``every`` (every part on)."""
    import trl_tiny as tiny
    from _trl_ranks_worker import _classes  # stock and parts on the same scripted completions
    from grpo_parts_adapters.trl import GRPOPartsTrainer
    from test_trl_vlm import _dataset, _reward
    from transformers import TrainerCallback, set_seed

    from grpo_parts.tiny_vision import tiny_processor, tiny_vlm

    grads: list[dict[str, torch.Tensor]] = []

    class Capture(TrainerCallback):  # DDP: p.grad is the all-reduced gradient here
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):  # type: ignore[no-untyped-def]
            grads.append(
                {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            )

    args = tiny.config(
        per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2, max_steps=2,
        optim="sgd", use_cpu=True, ddp_backend="gloo",
    )  # fmt: skip
    stock, scripted = _classes()
    parts: dict[str, Any] = {}
    cls: Any = stock
    if kind == "attention":
        cls, parts = scripted, {"attention": "shared_prefix"}
    elif kind == "every":
        cls = GRPOPartsTrainer
        parts = {"sampler": "reference", "attention": "shared_prefix", "filter": "cppo",
                 "filter_kwargs": {"pruning_rate": 0.5}}  # fmt: skip
    set_seed(0)
    model = tiny_vlm("qwen2_vl", dtype=torch.float32)
    trainer = cls(
        model=model, reward_funcs=_reward, args=args, train_dataset=_dataset(16),
        processing_class=tiny_processor(model), callbacks=[Capture()], **parts,
    )  # fmt: skip
    trainer.train()
    return {
        "grads": grads,
        "logs": [dict(x) for x in trainer.state.log_history],
        "reasons": dict(trainer._gp_counters.reasons) if kind != "stock" else {},
        "totals": {p: trainer._gp_counters.total(p) for p in ("sampler", "attention", "filter")}
        if kind != "stock"
        else {},
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    results: dict[str, Any] = {"runs": {}, "errors": {}}
    for kind in ("stock", "attention", "every"):
        try:
            results["runs"][kind] = run(kind)
        except Exception:
            results["errors"][kind] = traceback.format_exc()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
