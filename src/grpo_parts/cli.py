"""``grpo-parts`` command line. Subcommands are looked up in small tables and imported lazily.

Each bench module ``grpo_parts.bench.<name>`` exposes ``add_arguments(parser)`` and ``run(args) -> int``;
the train module ``grpo_parts.train.cli`` does the same.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

#: bench name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "sampler": (
        "grpo_parts.bench.sampler",
        "tokens/s of samplers vs the reference sampler and transformers generate",
    ),
    "attention": ("grpo_parts.bench.attention", "shared-prefix vs repeated-prefix forward+backward"),
    "filter": ("grpo_parts.bench.filter", "training-phase time vs CPPO pruning rate"),
    "e2e": ("grpo_parts.bench.e2e", "reference vs optimized parts end to end (= grpo-parts train --compare)"),
}
TRAIN_MODULE = "grpo_parts.train.cli"


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # parent package not there yet
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-parts",
        description="Drop-in accelerators for GRPO training: train with them, benchmark them.",
        epilog="Each command's options: grpo-parts COMMAND --help. Documentation: docs/index.md",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if _module_available(TRAIN_MODULE):
        train = sub.add_parser("train", help="GRPO training run (default: the built-in task on CPU)")
        importlib.import_module(TRAIN_MODULE).add_arguments(train)
        train.set_defaults(_module=TRAIN_MODULE)
    bench = sub.add_parser(
        "bench",
        help="side-by-side benchmarks (optimized vs reference)",
        description="Side-by-side benchmarks: each optimized part against its reference implementation.",
        epilog="Each benchmark's options: grpo-parts bench BENCH --help. Results: docs/results.md",
    )
    bench.set_defaults(_help_of=bench)
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for name, (module, help_text) in BENCHES.items():
        if not _module_available(module):
            continue
        p = bsub.add_parser(name, help=help_text, description=f"{help_text[0].upper()}{help_text[1:]}.")
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:  # a command without its subcommand: show what there is
        getattr(args, "_help_of", parser).print_help()
        return 2
    from .errors import GRPOPartsError

    try:
        return int(importlib.import_module(module).run(args) or 0)
    except GRPOPartsError as e:  # bad input: one line, no traceback
        command = " ".join(x for x in (args.command, getattr(args, "bench", None)) if x)
        print(f"grpo-parts {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
