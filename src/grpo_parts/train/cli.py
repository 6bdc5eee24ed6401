"""``grpo-parts train``: the built-in task by default, a local model + JSONL for real use.

grpo-parts train                                   # built-in task, optimized parts, ~5 min on 2 CPU cores
grpo-parts train --reference                       # the same with every part switched to its reference
grpo-parts train --compare                         # both, same seed and data; time to target accuracy
grpo-parts train --compare --seeds 3               # the same for 3 seeds; median speedup to target
grpo-parts train --config run.yaml --set lr=1e-4 --set parts.filter=keep_all
grpo-parts train --model ./my-checkpoint --data problems.jsonl --device cuda
grpo-parts train --resume runs/NAME --steps 200    # continue a run from its last checkpoint
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from ..errors import GRPOPartsError

#: flag -> dotted config key
_FLAGS = {
    "steps": "steps",
    "seed": "seed",
    "name": "name",
    "out_dir": "out_dir",
    "model": "model",
    "data": "data",
    "eval_data": "eval_data",
    "device": "device",
    "sampler": "parts.sampler",
    "draft": "parts.draft",
    "attention": "parts.attention",
    "filter": "parts.filter",
    "target": "target_accuracy",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(__doc__.splitlines()[2:]) if __doc__ else None
    parser.add_argument(
        "--config", type=Path, help="YAML file with TrainConfig fields (see docs/training.md)"
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any field, dotted (repeatable)",
    )
    parser.add_argument("--steps", type=int, help="GRPO steps")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--name", help="run folder name (default: a timestamp)")
    parser.add_argument("--out-dir", type=Path, help="parent folder of runs (default: runs)")
    parser.add_argument(
        "--model", type=Path, help="local transformers checkpoint folder (default: built-in warm start)"
    )
    parser.add_argument(
        "--data", type=Path, help='local JSONL of {"prompt", "answer"} (default: built-in task)'
    )
    parser.add_argument("--eval-data", type=Path, help="held-out JSONL (default: a split of --data)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--sampler", help="Sampler implementation name")
    parser.add_argument("--draft", help="DraftModel implementation name (speculative samplers)")
    parser.add_argument("--attention", help="AttentionBackend implementation name")
    parser.add_argument("--filter", help="CompletionFilter implementation name")
    parser.add_argument("--reference", action="store_true", help="every part its reference implementation")
    parser.add_argument(
        "--compare", action="store_true", help="run reference and optimized parts; report both"
    )
    parser.add_argument("--target", type=float, help="held-out accuracy for time-to-target (default 0.6)")
    parser.add_argument("--json", type=Path, help="--compare: also write the comparison JSON here")
    parser.add_argument(
        "--seeds", type=int, default=1,
        help="--compare: repeat for this many consecutive seeds and report the median (time to target is noisy)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue RUN_DIR from its last checkpoint"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and the result")


def config_from_args(args: argparse.Namespace) -> Any:
    from .config import load_config

    overrides: dict[str, Any] = {}
    for flag, key in _FLAGS.items():
        v = getattr(args, flag, None)
        if v is not None:
            overrides[key] = str(v) if isinstance(v, Path) else v
    if getattr(args, "no_progress", False):
        overrides["progress"] = False
    cfg = load_config(args.config, overrides, args.sets)
    if args.reference:
        cfg = cfg.with_reference_parts()
    return cfg


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(message)s"
    )
    try:
        return _run(args)
    except GRPOPartsError as e:
        print(f"grpo-parts train: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.compare:
        from .compare import compare, compare_seeds

        cfg = config_from_args(args)
        seeds = getattr(args, "seeds", 1)
        res = (
            compare_seeds(cfg, seeds, json_path=args.json) if seeds > 1 else compare(cfg, json_path=args.json)
        )
        print(res["markdown"])
        return 0
    from .run import resume_config, train

    if args.resume is not None:
        if args.config is not None or args.sets:
            raise GRPOPartsError("resume: --config/--set cannot change a run being resumed (only --steps)")
        cfg = resume_config(args.resume, {"steps": args.steps} if args.steps else None)
        result = train(cfg, run_dir=args.resume, resume=True)
    else:
        result = train(config_from_args(args))
    s = result.summary
    print(
        f"held-out accuracy {s['initial_accuracy']:.3f} -> {s['final_accuracy']:.3f} in {s['steps']} steps "
        f"({s['wall_time_s']:.0f} s training); report: {result.run_dir / 'report.md'}"
    )
    return 0
