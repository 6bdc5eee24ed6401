"""The speculative sampler's plain-decoding floor: ``draft_tokens=0`` (speculation off, every step
a plain one) vs the reference sampler on the bench's task policy, side by side in one process.

    PYTHONPATH=src python scripts/measure/bench_plain_floor.py [--batches 64,16] [--repeats 2] [--clock cpu]

Policy as ``grpo-parts bench sampler --policy task --hidden 256 --layers 24 --task-steps 400`` (from
the bench's cache, trained there on a miss), group size 1, temperature 1, 40 new tokens; per batch
size one warm-up rollout each, then 4 prompt batches x ``--repeats``, the two samplers alternating
first. Prints tokens per second (of process time with ``--clock cpu``) and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from grpo_parts.bench.sampler import bench_prompts, eos_kwargs, make_policy
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,16", help="comma-separated batch sizes (default: 64,16)")
    ap.add_argument(
        "--repeats", type=int, default=2, help="timed rollouts per prompt batch and sampler (default: 2)"
    )
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="cpu", help="wall time or process CPU time (default: cpu)"
    )
    cli = ap.parse_args()
    clock = time.process_time if cli.clock == "cpu" else time.perf_counter
    args = argparse.Namespace(
        policy="task", hidden=256, layers=24, task_steps=400, seed=0,
        cache_dir="~/.cache/grpo_parts/bench", prompt_len=16, vocab=0,
    )  # fmt: skip
    policy = make_policy(args)
    params = SamplingParams(group_size=1, max_new_tokens=40, temperature=1.0, **eos_kwargs(args))
    samplers = {
        "reference": ReferenceSampler(policy),
        "k=0": SpeculativeSampler(policy, NGramDraft(), SpeculativeConfig(draft_tokens=0, train_draft=False)),
    }
    for b in (int(x) for x in cli.batches.split(",")):
        g = torch.Generator().manual_seed(0)
        tot = {name: [0.0, 0] for name in samplers}
        calls = 0.0
        for s in samplers.values():  # warm-up
            s.generate(bench_prompts(args, b, 1, 99), params, g)
        for r in range(4):
            prompts = bench_prompts(args, b, 1, args.seed + r)
            for rep in range(cli.repeats):
                names = list(samplers) if (r + rep) % 2 == 0 else list(samplers)[::-1]
                for name in names:
                    t0 = clock()
                    ro = samplers[name].generate(prompts, params, g)
                    tot[name][0] += clock() - t0
                    tot[name][1] += int(ro.completion_mask.sum())
                    calls += ro.stats.get("decode_attention_plain_gqa_calls", 0.0)
        ref, k0 = (tot[n][1] / tot[n][0] for n in samplers)
        print(
            f"batch {b}: reference {ref:.1f} tok/s, speculative k=0 {k0:.1f} tok/s -> {k0 / ref:.3f}x "
            f"(grouped GQA attention calls: {calls:.0f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
