"""What every report writer of a run folder shares: matplotlib without a window, and how a
number (or a missing one) appears in a Markdown table."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, never a window)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def fmt(v: Any, spec: str = ".3f") -> str:
    """``v`` for a report table: ``"-"`` for None, floats with ``spec``, anything else as ``str``."""
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)
