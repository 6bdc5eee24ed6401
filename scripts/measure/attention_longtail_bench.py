"""Shared-prefix attention on a real long-tailed rollout: reference vs one grid vs the chunked plan.

Rolls out the built-in reasoning warm start (16 prompts x G = 8, temperature 1, <= 320 new tokens,
reference sampler, 1 torch thread), then times ``completion_logprobs`` (no grad, and forward +
backward of the summed log-probs; best of 2) on all 128 rows and on a CPPO-like kept quarter (top
|advantage|) with ``RepeatedPrefixAttention``, ``SharedPrefixAttention(max_chunks=1)`` (one grid)
and ``SharedPrefixAttention()`` (the default plan). Prints one line per case with the plan.

    python scripts/measure/attention_longtail_bench.py     # ~1 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.task.data import decode_completions, encode_prompts
from grpo_parts.task.reasoning import ReasoningTask
from grpo_parts.train.lifecycle.setup import builtin_model_path, load_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="seed of the problems and the rollout (default: 0)")
    return p.parse_args()


def timeit(model: torch.nn.Module, backend: Any, batch: LogprobBatch, grad: bool) -> float:
    """Best of 2 ``completion_logprobs`` calls (with ``grad``: forward + backward of the sum)."""
    best = 1e9
    for _ in range(2):
        t0 = time.perf_counter()
        if grad:
            out = backend.completion_logprobs(model, batch)
            out.logprobs.sum().backward()
        else:
            with torch.no_grad():
                backend.completion_logprobs(model, batch)
        best = min(best, time.perf_counter() - t0)
    return best


def rollout(seed: int) -> tuple[torch.nn.Module, LogprobBatch, torch.Tensor]:
    """The warm start's rollout of 16 reasoning prompts x 8: model, log-prob batch, advantages."""
    model, tok = load_model(
        builtin_model_path("reasoning"), torch.float32, torch.device("cpu"), progress=False
    )
    task = ReasoningTask(seed=seed)
    probs = [task.train_problem(i) for i in range(16)]
    pb = encode_prompts(tok, [p.prompt for p in probs])
    params = SamplingParams(
        group_size=8, max_new_tokens=320, temperature=1.0, eos_token_ids=(1,), pad_token_id=0
    )
    ro = ReferenceSampler(model).generate(pb, params, torch.Generator().manual_seed(seed))
    texts = decode_completions(tok, ro)
    r = torch.tensor([task.reward(t, probs[g]) for t, g in zip(texts, ro.group_index.tolist())])
    return model, LogprobBatch.from_rollout(ro), group_advantages(r, ro.group_index, AdvantageConfig())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    model, full, adv = rollout(args.seed)
    lengths = full.completion_mask.sum(-1)
    print(
        "rows", full.prompt_ids.shape, "completion max", int(lengths.max()), "median", int(lengths.median())
    )
    # a CPPO-like kept set: top quarter by |adv| (random tie-break when adv degenerate)
    score = adv.abs() + 1e-3 * torch.rand(len(adv), generator=torch.Generator().manual_seed(1))
    kept = torch.argsort(score, descending=True)[: len(adv) // 4]
    sub = LogprobBatch(
        full.prompt_ids[kept],
        full.prompt_mask[kept],
        full.completion_ids[kept],
        full.completion_mask[kept],
        full.group_index[kept],
    )
    for name, batch in (("all rows", full), ("kept quarter", sub)):
        for grad in (False, True):
            ref = timeit(model, RepeatedPrefixAttention(), batch, grad)
            t1 = timeit(model, SharedPrefixAttention(max_chunks=1), batch, grad)
            ch = SharedPrefixAttention()
            t2 = timeit(model, ch, batch, grad)
            print(
                f"{name:13s} grad={grad!s:5s} ref {ref:.3f}s  one-grid {t1:.3f}s ({ref / t1:.2f}x)  "
                f"chunked {t2:.3f}s ({ref / t2:.2f}x) plan {ch.last_plan}"
            )


if __name__ == "__main__":
    main()
