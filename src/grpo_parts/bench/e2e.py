"""``grpo-parts bench e2e``: reference vs optimized parts end to end (the same as ``train --compare``).

JSON keys (``--json PATH``): ``target_accuracy``, ``speedup_to_target``, ``mean_step_speedup``,
``final_accuracy_diff``, ``passes`` and ``runs.{reference,optimized}`` summaries.
"""

from __future__ import annotations

import argparse

from ..train import cli as train_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    train_cli.add_arguments(parser)
    parser.set_defaults(compare=True)


def run(args: argparse.Namespace) -> int:
    args.compare = True
    return train_cli.run(args)
