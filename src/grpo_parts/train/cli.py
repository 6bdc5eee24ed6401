"""``grpo-parts train``: GRPO training on the built-in task by default, a local model + JSONL for real use."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any

from ..errors import GRPOPartsError
from .flags import FLAGS, NO_DRAFT, check_flags
from .reporting.report_format import fmt

#: How long ``grpo-parts train`` (the main job, default settings) takes; quoted verbatim in README.md,
#: docs/training.md and ``--help`` (tests/test_cli_help.py): re-measure and update all three here.
MAIN_JOB_RUNTIME = "about 70 s on an idle 2-core CPU"

DESCRIPTION = (
    "GRPO training run: by default a tiny committed policy on the built-in reasoning-shaped task (a long "
    "shared instruction, long-tailed worked solutions), on the CPU, with the optimized parts on; "
    "--set task.name=arithmetic is the short chain-addition task; --model and --data train your own "
    "local checkpoint."
)

EXAMPLES = f"""\
examples:
  grpo-parts train                                   # built-in task, optimized parts: {MAIN_JOB_RUNTIME}
  grpo-parts train --reference                       # the same with every part switched to its reference
  grpo-parts train --compare                         # both, same seed and data; time to target accuracy
  grpo-parts train --compare --seeds 3               # the same for 3 seeds; median speedup to target
  grpo-parts train --config run.yaml --set lr=1e-4 --set parts.filter=keep_all
  grpo-parts train --model ./my-checkpoint --data problems.jsonl --device cuda
  grpo-parts train --resume runs/NAME --steps 200    # continue a run from its last checkpoint

precedence: the --config file first, flags and --set on top of it. A flag and a --set that name the
same field must agree. --reference replaces any parts the --config file sets, and cannot be combined
with --sampler/--draft/--attention/--filter, --set parts.* or --compare.
Details: docs/training.md"""

#: part flag -> what it selects
PART_FLAGS = {
    "sampler": "Sampler",
    "draft": "DraftModel (speculative samplers only)",
    "attention": "AttentionBackend",
    "filter": "CompletionFilter",
}


def part_names(part: str) -> list[str]:
    names = sorted(importlib.import_module(f"grpo_parts.{part}").IMPLEMENTATIONS)
    return [*names, NO_DRAFT] if part == "draft" else names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``grpo-parts train``: the run options below, plus --reference, --compare and --resume."""
    parser.description = textwrap.fill(DESCRIPTION, 100)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    add_run_arguments(parser, compare_prefix="--compare: ")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="every part its reference implementation (replaces the parts of --config; not with part flags, "
        "--set parts.* or --compare)",
    )
    parser.add_argument(
        "--compare", action="store_true", help="run reference and optimized parts; report both"
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="--compare: also run each optimized part alone (the reference with only that part swapped "
        "in), in the same alternation, and report the step speedup their isolated phase ratios predict "
        "composed (amdahl_isolated) and measured / predicted (composition); about 2.5x the time",
    )
    from .experiments.arms import ARMS  # the one table of arms; the help lists it as it is

    parser.add_argument(
        "--arms",
        nargs="+",
        metavar="ARM",
        default=None,
        help=f"--compare: the arms to run side by side, from {', '.join(ARMS)} "
        "(default: reference optimized); filter arms keep the configured sampler and "
        "attention; report arms.{json,md,png}: time/steps/rollout tokens to target, zero-variance share, "
        "prompts skipped, final accuracy",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its last checkpoint (or RUN_DIR/checkpoints/step-N from that one)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (--config, flags and --set applied; with --resume the run's) as "
        "YAML that --config loads, and exit without running",
    )
    parser.add_argument(
        "--rewind",
        action="store_true",
        help="--resume from an earlier checkpoint of a run that went further: move the later state "
        "(checkpoints, model/, a copy of the other files) aside into RUN_DIR/rewound-K/ first",
    )


def _run_default(field: str) -> Any:
    """What a run without --config/--set gets: the default task's defaults win over the field's."""
    from .config import DEFAULT_TASK, TASK_DEFAULTS, TrainConfig

    return TASK_DEFAULTS[DEFAULT_TASK].get(field, TrainConfig.model_fields[field].default)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="YAML file with TrainConfig fields (see docs/training.md)"
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any TrainConfig field, dotted, YAML value (repeatable; e.g. loss.kl_coef=0.01)",
    )


def _add_hyperparameter_arguments(parser: argparse.ArgumentParser) -> None:
    from .config import TrainConfig

    parser.add_argument(
        "--steps",
        type=int,
        help=f"GRPO steps (default: {_run_default('steps')}; {TrainConfig.model_fields['steps'].default} with "
        "task.name=arithmetic)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help=f"seed of the data stream, sampling and init (default: {_run_default('seed')})",
    )
    parser.add_argument(
        "--group-size", type=int, help=f"completions per prompt, G (default: {_run_default('group_size')})"
    )
    parser.add_argument("--lr", type=float, help=f"learning rate (default: {_run_default('lr')})")


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="run folder name (default: a timestamp)")
    parser.add_argument("--out-dir", type=Path, help="parent folder of runs (default: runs)")
    parser.add_argument(
        "--model", type=Path, help="local transformers checkpoint folder (default: built-in warm start)"
    )
    parser.add_argument(
        "--data",
        type=Path,
        help="your problems: JSONL, parquet or a save_to_disk folder of prompt/answer, chat messages, GSM8K "
        "question/answer or MATH problem/solution records (task.format, task.grader; default: built-in task)",
    )
    parser.add_argument(
        "--eval-data", type=Path, help="held-out problems, as --data (default: a split of --data)"
    )
    parser.add_argument(
        "--reward",
        action="append",
        metavar="MODULE:FUNCTION[@WEIGHT]",
        help="a reward function with TRL's signature (completions, **kwargs) -> list[float] (repeatable; "
        "weight 1 by default); their weighted sum is the training reward (config key: rewards)",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help=f"where the policy runs; auto = cuda when available (default: {_run_default('device')})",
    )


def _add_part_arguments(parser: argparse.ArgumentParser) -> None:
    from ..parts_config import DOOR_DEFAULTS

    for part, what in PART_FLAGS.items():
        names = part_names(part)
        fallback = DOOR_DEFAULTS["train"].get(part)
        parser.add_argument(
            f"--{part}",
            choices=names,
            metavar="NAME",
            help=f"{what}: one of {', '.join(names)} (default: {fallback or NO_DRAFT})",
        )


def _add_output_arguments(parser: argparse.ArgumentParser, compare_prefix: str) -> None:
    parser.add_argument(
        "--target",
        type=float,
        help=f"held-out accuracy for time-to-target (default: {_run_default('target_accuracy')})",
    )
    parser.add_argument(
        "--report-to",
        nargs="+",
        metavar="TRACKER",
        help="log every metrics row and the config to: none (default), tensorboard, wandb, mlflow, trackio "
        "(several allowed; each needs the pip extra of its name, e.g. [wandb])",
    )
    parser.add_argument("--json", type=Path, help=f"{compare_prefix}also write the comparison JSON here")
    parser.add_argument(
        "--seeds", type=_positive_int, default=1,
        help=f"{compare_prefix}repeat for this many consecutive seeds and report the median "
        "(time to target is noisy; default: 1)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and the result")


def add_run_arguments(parser: argparse.ArgumentParser, compare_prefix: str = "") -> None:
    """The options a training run and ``grpo-parts bench e2e`` share (``--help`` lists them in this order)."""
    _add_config_arguments(parser)
    _add_hyperparameter_arguments(parser)
    _add_input_arguments(parser)
    _add_part_arguments(parser)
    _add_output_arguments(parser, compare_prefix)


def config_from_args(args: argparse.Namespace) -> Any:
    from .config import load_config

    overrides = {key: value for key, (_, value) in check_flags(args).items()}
    cfg = load_config(args.config, overrides, args.sets)
    if getattr(args, "reference", False):
        cfg = cfg.with_reference_parts()
    return cfg


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(message)s"
    )
    from .lifecycle.interrupt import Interrupted, raise_on_signals

    try:
        with raise_on_signals():  # SIGTERM too ends in one line, not a silent kill or a traceback
            return _run(args)
    except GRPOPartsError as e:
        print(f"grpo-parts train: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(e, file=sys.stderr)
        return e.exit_code


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "rewind", False) and args.resume is None:
        raise GRPOPartsError("--rewind: only used with --resume, got it without")
    if getattr(args, "print_config", False):
        return _print_config(args)
    if getattr(args, "arms", None) is not None and not args.compare:
        raise GRPOPartsError("--arms: only used with --compare, got it without")
    if args.compare:
        from .experiments.compare import compare, compare_seeds

        cfg = config_from_args(args)
        seeds = getattr(args, "seeds", 1)
        kw: dict[str, Any] = {"ablate": getattr(args, "ablate", False), "arms": getattr(args, "arms", None)}
        kw["json_path"] = args.json
        res = compare_seeds(cfg, seeds, **kw) if seeds > 1 else compare(cfg, **kw)
        print(res["markdown"])
        return 0
    from .lifecycle.run import resume_config, train

    if args.resume is not None:
        _check_resume_flags(args)
        overrides = {"steps": args.steps} if args.steps is not None else {}
        if args.no_progress:
            overrides["progress"] = False
        cfg = resume_config(args.resume, overrides)
        result = train(cfg, run_dir=args.resume, resume=True, rewind=args.rewind)
    else:
        result = train(config_from_args(args))
    print(headline(result.summary, result.run_dir))
    return 0


def headline(s: dict[str, Any], run_dir: Path) -> str:
    """The one stdout line of a finished run: the final accuracy says what it averages, and the last one."""
    n = s.get("final_evals", 0)
    last = f"mean of the last {n} evaluations; the last: {fmt(s['last_accuracy'])}"
    what = last if n > 1 else "one evaluation"
    return (
        f"held-out accuracy {fmt(s['initial_accuracy'])} -> {fmt(s['final_accuracy'])} ({what}) in "
        f"{s['steps']} steps ({s['wall_time_s']:.0f} s training); report: {run_dir / 'report.md'}"
    )


def _print_config(args: argparse.Namespace) -> int:
    """The config a run with these arguments would use, as YAML for --config; nothing is run or written."""
    from .config import dump_config
    from .lifecycle.run import resume_config

    if args.resume is not None:
        _check_resume_flags(args)
        cfg = resume_config(args.resume, {"steps": args.steps} if args.steps is not None else {})
    else:
        cfg = config_from_args(args)
    what = (
        "--compare's optimized arm (the reference arm: every part its reference)" if args.compare else "run"
    )
    print(f"# grpo-parts train: the effective config of this {what}; load it with --config FILE")
    print(dump_config(cfg), end="")
    return 0


def _check_resume_flags(args: argparse.Namespace) -> None:
    """A resumed run keeps the config of its checkpoint: only --steps may change (and the output)."""
    given = [f"--{d.replace('_', '-')}" for d in FLAGS if d != "steps" and getattr(args, d, None) is not None]
    for flag, on in (
        ("--config", args.config is not None),
        ("--set", bool(args.sets)),
        ("--reference", getattr(args, "reference", False)),
        ("--reward", bool(getattr(args, "reward", None))),
    ):
        given += [flag] if on else []
    if given:
        raise GRPOPartsError(
            f"resume: {', '.join(given)} cannot change a run being resumed; expected only --steps "
            "(its config is the checkpoint's)"
        )
