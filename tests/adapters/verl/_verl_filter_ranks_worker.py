"""One rank of test_filter_ranks.py (``python _verl_filter_ranks_worker.py OUT_DIR`` under
multirank.run_ranks).

verl 0.9.1's own actor ``TrainingWorker`` (what ``ActorRolloutRefWorker.update_actor`` runs:
``train_mini_batch`` -> mini-batch iterator, token counts all-gathered over the ranks,
``train_batch`` -> the FSDP2 engine, ``ppo_loss``, one optimizer step per mini-batch) on a two-rank
gloo group, fed this rank's share of the filtered batch: the TensorDict verl's ``tqbridge`` fetched
from TransferQueue for the chunk verl's dispatch gave this rank, written by the test's controller to
``OUT_DIR/shares.pt``. Per case: the rows of every micro-batch the loss saw (token ids, loss
tokens, advantages) and the mini-batches (optimizer steps) this rank ran.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verl_ranks_worker import actor_config, run_worker  # noqa: E402

#: ``actor_rollout_ref.actor.ppo_mini_batch_size`` (x rollout.n = 4 rows per optimizer step: 2 per
#: rank) and ``ppo_micro_batch_size_per_gpu``, as in the controller's verl config
MINI_BATCH, MICRO_BATCH = 1, 1


@functools.cache
def training_worker(model_dir: str) -> tuple[Any, list[dict[str, Any]]]:
    """verl's actor TrainingWorker, configured as ``ActorRolloutRefWorker.init_model`` does; the loss
    records each micro-batch it sees into the returned list."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    model, cfg = actor_config(
        model_dir, "fsdp2", None, False, True, mini_batch=MINI_BATCH, micro_batch=MICRO_BATCH
    )
    wcfg = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model,
        engine_config=cfg.engine,
        optimizer_config=cfg.optim,
        checkpoint_config=CheckpointConfig(),
    )
    wcfg.engine_config.use_dynamic_bsz = False
    wcfg.engine_config.micro_batch_size_per_gpu = MICRO_BATCH
    wcfg.engine_config.use_remove_padding = True
    worker = TrainingWorker(wcfg)
    worker.reset()
    seen: list[dict[str, Any]] = []

    def loss(model_output: Any, data: Any, dp_group: Any = None) -> Any:
        adv = data["advantages"]
        mask = data["response_mask"]
        seen.append({
            "rows": [tuple(t.tolist()) for t in data["input_ids"].unbind()],
            "loss_tokens": int(sum(int(m.sum()) for m in mask.unbind())),
            "min_abs_adv": min(float(a.abs().max()) for a in adv.unbind()),
        })  # fmt: skip
        return ppo_loss(cfg, model_output, data, dp_group)

    worker.set_loss_fn(loss)
    return worker, seen


def run_case(model_dir: str, rank: int, name: str) -> dict[str, Any]:
    worker, seen = training_worker(model_dir)
    share = torch.load(Path(model_dir).parent / "shares.pt", weights_only=False)[name][rank]
    seen.clear()
    mini_batches = []
    train_batch = type(worker).train_batch

    def counting(data: Any) -> Any:  # one call per mini-batch: one optimizer step
        mini_batches.append(int(data.batch_size[0]))
        return train_batch(worker, data)

    worker.train_batch = counting
    try:
        out = worker.train_mini_batch(share)
    finally:
        del worker.train_batch
    return {
        "share_rows": int(share.batch_size[0]),
        "mini_batches": mini_batches,
        "micro_batches": list(seen),
        "grad_norms": [float(g) for g in out["metrics"]["grad_norm"]],
    }


if __name__ == "__main__":
    cases = torch.load(Path(sys.argv[1]) / "shares.pt", weights_only=False)
    run_worker([(name,) for name in cases], run_case)
