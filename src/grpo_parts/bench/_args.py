"""Argument types shared by the bench commands: comma-separated lists checked when parsed."""

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
