"""A TRL VLM user's comparison (#55): TRL's stock ``GRPOTrainer`` against ``GRPOPartsTrainer`` on
the same vision-language workload -- a tiny Qwen2-VL from a config, its offline processor
(``grpo_parts.tiny_vision``), an image dataset in TRL's format, TRL 1.16's defaults otherwise.

The parts arm runs the reference sampler (each prompt and its images prefilled once per group,
where TRL's ``generate`` encodes them once per completion) and the shared-prefix backend (the
vision tower and the prompt once per group in every log-prob forward); filters are left out so
that both arms train on the same rows. Each (arm, seed) runs in its own process, arms alternating.

Reported per arm: seconds per optimizer step (TRL's ``step_time`` metric: generation, scoring and
the update; the first ``--skip-first`` steps left out) and the parts arm's counters;
``step_speedup`` = stock / parts mean step time per seed, averaged. ``--json`` keys: ``workload``,
``machine``, ``date``, ``commit``, ``arms.<arm>.seeds.<seed>.{step_s, counters}``,
``step_s_mean``, ``step_speedup``.

    python scripts/measure/trl_vlm_vs_stock.py --image-tokens 256 --json /tmp/trl_vlm.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ARMS = ("stock", "parts")
COUNTERS = ("parts/sampler/rollouts", "parts/attention/forwards")


def _dataset(n: int, image_tokens: int, seed: int) -> Any:
    """``n`` prompts, each one image of ``image_tokens`` merged patches (a square grid) and a
    question; Qwen2-VL's tiny tower merges 2 x 2 patches of 2 x 2 pixels."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    side = int(round(image_tokens**0.5)) * 4  # pixels: tokens = (side / 4) ** 2
    rng = np.random.default_rng(seed)
    texts = ["how many a", "what b c", "d e f", "how many g h"]
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": texts[i % 4]}]}]
                for i in range(n)
            ],
            "image": [
                Image.fromarray((rng.random((side, side, 3)) * 255).astype(np.uint8)) for _ in range(n)
            ],
        }
    )


def _reward(completions: list[Any], **_: Any) -> list[float]:
    """Vowel words minus a little length: spread out, so every group has an advantage."""
    words = [c[0]["content"].split() for c in completions]
    return [sum(w in "aeiou" for w in ws) - 0.1 * len(ws) for ws in words]


def run_child(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from grpo_parts_adapters.trl import GRPOPartsTrainer
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    from grpo_parts.tiny_vision import tiny_processor, tiny_vlm

    torch.set_num_threads(args.threads)
    set_seed(seed)
    model = tiny_vlm(
        "qwen2_vl", hidden_size=args.hidden, num_layers=args.layers, vision_layers=2, vision_hidden=32
    )
    out = tempfile.mkdtemp(prefix="trl_vlm_")
    config = GRPOConfig(
        output_dir=out, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.max_completion_length, max_steps=args.steps, logging_steps=1,
        learning_rate=1e-4, seed=seed,
    )  # fmt: skip
    parts = {"sampler": "reference", "attention": "shared_prefix"} if arm == "parts" else {}
    cls = GRPOPartsTrainer if arm == "parts" else GRPOTrainer
    trainer = cls(
        model=model, reward_funcs=_reward, args=config, processing_class=tiny_processor(model, max_image_tokens=args.image_tokens),
        train_dataset=_dataset(args.prompts * args.steps, args.image_tokens, seed), **parts,
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    return {
        "step_s": [float(h["step_time"]) for h in logs],
        "counters": {k: sum(float(h.get(k, 0)) for h in logs) for k in COUNTERS} if arm == "parts" else {},
        "fallbacks": {k: sum(float(h.get(k, 0)) for h in logs) for k in logs[0] if k.endswith("/fallbacks")},
    }


def _spawn(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        argv = [a for a in sys.argv[1:] if not a.startswith("--child")]
        cmd = [
            sys.executable,
            __file__,
            *argv,
            "--child",
            arm,
            "--child-seed",
            str(seed),
            "--child-out",
            f.name,
        ]
        subprocess.run(cmd, check=True)
        return dict(json.loads(Path(f.name).read_text()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per arm per seed")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    p.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--image-tokens", type=int, default=256, help="image tokens per prompt (a square grid)")
    p.add_argument("--max-completion-length", type=int, default=32, help="TRL's max_completion_length")
    p.add_argument("--hidden", type=int, default=64, help="the tiny Qwen2-VL's hidden size")
    p.add_argument("--layers", type=int, default=2, help="its decoder layers")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run")
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps left out of the mean")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--child", choices=ARMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(run_child(args.child, args.child_seed, args)))
        return 0
    results: dict[str, dict[int, Any]] = {a: {} for a in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            results[arm][seed] = _spawn(arm, seed, args)
    mean = {
        a: {s: statistics.mean(r["step_s"][args.skip_first :]) for s, r in results[a].items()} for a in ARMS
    }
    speedups = [mean["stock"][s] / mean["parts"][s] for s in args.seeds]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "workload": {k: v for k, v in vars(args).items() if not k.startswith("child") and k != "json"},
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} torch threads",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "arms": {a: {"seeds": results[a]} for a in ARMS},
        "step_s_mean": {a: statistics.mean(mean[a].values()) for a in ARMS},
        "step_speedup": statistics.mean(speedups),
    }
    for a in ARMS:
        print(f"{a:6s} {report['step_s_mean'][a]:.3f} s/step  {results[a][args.seeds[0]].get('counters')}")
    print(f"step_speedup {report['step_speedup']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
