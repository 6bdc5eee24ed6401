"""Batch-1 speculative sampling on the bench's task policy and EAGLE head: ms per emitted token of
the reference and speculative samplers on 22 task prompts, one row each, after a 2-prompt warm-up;
optionally a cProfile of 10 rollouts (docs/history/benchmarks-log.md, "Lean decode forwards").

    python scripts/measure/spec_batch1.py [on|off] [noprof]    # on/off: SpeculativeConfig.lean_forward

Needs the bench cache (``grpo-parts bench sampler --policy task --hidden 256 --layers 24
--task-steps 400 ...`` trains and caches the policy and the head once). Timing: run alone.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from grpo_parts.bench import sampler as bs
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler


def parse_args() -> argparse.Namespace:
    """``[on|off] [noprof]`` as before: any order, each at most once."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "words",
        nargs="*",
        metavar="on|off|noprof",
        help="off: SpeculativeConfig.lean_forward='off' (default on); noprof: skip the cProfile of 10 rollouts",
    )
    args = p.parse_args()
    bad = [w for w in args.words if w not in ("on", "off", "noprof")]
    if bad:
        p.error(f"expected on, off or noprof, got {' '.join(bad)}")
    return args


def main(argv: list[str]) -> None:
    bench = argparse.ArgumentParser()  # the bench's own options, fixed to the command
    bs.add_arguments(bench)
    args = bench.parse_args(
        "--policy task --hidden 256 --layers 24 --task-steps 400 --max-new-tokens 40 "
        "--spec-warmup 0 --spec-drafts eagle --spec-shapes chains".split()
    )
    torch.set_num_threads(2)
    policy = bs.make_policy(args)
    spec = bs.FACTORIES["speculative"](policy, args)[0].sampler
    if "off" in argv:
        spec.config = spec.config.model_copy(update={"lean_forward": "off"})
    ref = ReferenceSampler(policy)
    params = SamplingParams(group_size=1, max_new_tokens=40, temperature=1.0, **bs.eos_kwargs(args))
    prompts = [bs.bench_prompts(args, 1, 1, s) for s in range(24)]
    for pb in prompts[:2]:
        for s in (spec, ref):
            s.generate(pb, params, torch.Generator().manual_seed(0))
    for name, s in (("ref", ref), ("spec", spec)):
        t0, tok, apv = time.perf_counter(), 0, []
        for i, pb in enumerate(prompts[2:]):
            ro = s.generate(pb, params, torch.Generator().manual_seed(i))
            tok += int(ro.completion_mask.sum())
            apv.append(ro.stats.get("accepted_per_verify", 1.0))
        dt = time.perf_counter() - t0
        print(
            f"{name}: {tok / dt:.1f} tok/s, {1000 * dt / tok:.2f} ms/token, "
            f"apv {sum(apv) / len(apv):.2f}, lean {ro.stats.get('lean_forward_calls')}"
        )
    if "noprof" in argv:
        return
    pr = cProfile.Profile()
    pr.enable()
    for i, pb in enumerate(prompts[2:12]):
        spec.generate(pb, params, torch.Generator().manual_seed(i))
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(35)


if __name__ == "__main__":
    main(parse_args().words)
