"""What the bench commands share on their command lines: the options every one takes
(:func:`add_common`) and comma-separated lists checked when parsed."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def names(valid: Iterable[str]) -> Callable[[str], str]:
    """An argparse ``type``: a comma-separated subset of ``valid``, returned as given."""
    allowed = list(valid)

    def check(text: str) -> str:
        bad = [n for n in text.split(",") if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {allowed}, got {bad[0]!r}")
        return text

    return check


def ints(text: str) -> str:
    """An argparse ``type``: comma-separated positive integers, returned as given."""
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {part!r}")
    return text


def add_common(
    p: argparse.ArgumentParser, *, quick: str, summary: str, model: str, hidden: int, layers: int, vocab: int
) -> None:
    """The options every bench takes: ``--json``, ``--quick`` (what it runs: ``quick``), ``--repeats``
    (the ``summary`` of a point's runs is reported), ``--clock``, ``--threads``, ``--seed`` and the
    ``model``'s ``--hidden`` / ``--layers`` / ``--vocab`` (with these defaults)."""
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument(
        "--repeats", type=int, default=3, help=f"timed runs per point, {summary} (default: %(default)s)"
    )
    p.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="wall: perf_counter; cpu: process CPU time (all threads) -- steadier on a shared, loaded machine",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--seed", type=int, default=0, help=f"seed of the {model} and inputs (default: %(default)s)"
    )
    p.add_argument("--hidden", type=int, default=hidden, help=f"{model} hidden size (default: %(default)s)")
    p.add_argument(
        "--layers", type=int, default=layers, help=f"{model} decoder layers (default: %(default)s)"
    )
    p.add_argument("--vocab", type=int, default=vocab, help="vocabulary size (default: %(default)s)")
