"""Main-job rollouts of the speculative sampler: each decode forward's measured time beside the cost
model's prediction (docs/speculative.md, "calibration"; issue 22).

    python scripts/measure/cost_predictions.py [BATCHES]

The default ``grpo-parts train`` config's policy, prompts (16 x group) and speculative sampler; the
first rollout calibrates (untimed here), then BATCHES rollouts are generated. Per calibrated batch
size and tokens per row ``T`` of the forward: forwards, mean measured ms, mean ``t_verify(A, T)``
from the start-up table (before the online rescaling), their ratio and the mean cache length.
A ratio that differs between ``T`` at one batch size is a wrong *shape* in ``T``, which online
rescaling keeps and which sets the draft lengths. Timing: run alone, 1 thread.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch

from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import build_trainer
from grpo_parts.train.step.loop import ProblemStream


def main(batches: int) -> None:
    torch.set_num_threads(1)
    tr, _ = build_trainer(load_config(None, {"progress": False}, []))
    spec: Any = tr.parts.sampler
    rec: list[list[Any]] = []

    def pre(_m: Any, _a: Any, kw: dict[str, Any]) -> None:
        mask = kw.get("attention_mask")
        rec.append([tuple(kw["input_ids"].shape), 0 if mask is None else mask.shape[-1], time.perf_counter()])

    def post(_m: Any, _a: Any, _kw: dict[str, Any], _out: Any) -> None:
        rec[-1].append(time.perf_counter())

    tr.policy.register_forward_pre_hook(pre, with_kwargs=True)
    tr.policy.register_forward_hook(post, with_kwargs=True)
    stream, gen = ProblemStream(tr), torch.Generator().manual_seed(0)
    agg: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for it in range(batches + 1):
        rec.clear()
        spec.generate(tr.prompt_batch([next(stream) for _ in range(16)]), tr.params, gen)
        if it == 0:
            continue
        for (a, t), cols, t0, t1 in rec[1:]:  # [0]: the prefill
            x = agg[(spec.cost.bucket(a), t)]
            x[0] += 1
            x[1] += t1 - t0
            x[2] += spec.cost.t_verify(a, t)
            x[3] += cols
    for (b, t), (n, real, pred, cols) in sorted(agg.items()):
        if n >= 3:
            print(
                f"A~{b:3d} T={t}: {int(n):4d} forwards, measured {real / n * 1e3:6.2f} ms, "
                f"predicted {pred / n * 1e3:6.2f} ms, ratio {real / pred:.2f}, cache {cols / n:.0f}"
            )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "batches",
        nargs="?",
        type=int,
        default=3,
        help="rollouts timed after the calibrating one (default: 3)",
    )
    return p.parse_args()


if __name__ == "__main__":
    main(parse_args().batches)
