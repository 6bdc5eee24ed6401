"""``grpo-parts bench e2e``: reference vs optimized parts end to end (the same as ``train --compare``);
its JSON keys are listed in :data:`EPILOG`."""

from __future__ import annotations

import argparse
import textwrap

from ..train import cli as train_cli

DESCRIPTION = (
    "End-to-end benchmark: two GRPO runs from the same config, seed, data stream and held-out set, one "
    "with every part its reference implementation and one with the parts as configured (optimized by "
    "default), stepped in alternation so load on a shared machine slows both alike. Reports the "
    "training time to the target held-out accuracy of each, the speedup, the mean step speedup and the "
    "final accuracy difference; writes a folder with both runs and compare.{json,md,png}. "
    "The same as grpo-parts train --compare."
)
EPILOG = """\
examples:
  grpo-parts bench e2e                               # the built-in task, default parts
  grpo-parts bench e2e --seeds 3 --json e2e.json     # 3 seeds: median speedup to target
  grpo-parts bench e2e --sampler reference           # ablation: optimized attention and filter only
  grpo-parts bench e2e --device cuda --preset h200   # GPU: Qwen2.5-0.5B-shaped policy, tokens/s/GPU per arm

JSON keys (--json): target_accuracy, speedup_to_target, mean_step_speedup, final_accuracy_diff,
passes, runs.{reference,optimized}; with --seeds N > 1: target_accuracy, seeds,
median_speedup_to_target, speedups_to_target, mean_step_speedup, mean_final_accuracy_diff, passes,
per_seed (each seed's single-seed JSON). Both also: speedup_to_target, step_speedup,
accuracy_diff, rollout_share, amdahl_bound, phases (per seed and as medians over seeds).
--preset h200|tiny: model, parameters, context_length, group_size, arms.{reference,optimized,vllm}
(tokens_per_s_per_gpu, step_s, phase_shares, ...), step_speedup.
Details: docs/training.md (--compare) and docs/results.md"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = textwrap.fill(DESCRIPTION, 100)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    train_cli.add_run_arguments(parser)
    parser.add_argument(
        "--preset",
        choices=["h200", "tiny"],
        help="throughput benchmark instead of the time-to-target comparison: build a policy of this "
        "preset's shape (h200: Qwen2.5-0.5B-shaped, random init + a short SFT on the built-in reasoning "
        "task; tiny: a CPU test size), run a few GRPO steps per arm (reference, optimized, vllm when "
        "installed) and report tokens/s/GPU, step time and phase shares; uses --device and --json",
    )
    parser.set_defaults(compare=True, reference=False, resume=None)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "preset", None):
        from .gpu_e2e import run_preset

        res = run_preset(args.preset, args.device or "auto", args.json)
        print(res["markdown"])
        return 0
    args.compare = True
    return train_cli.run(args)
