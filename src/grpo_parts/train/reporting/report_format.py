"""What every report writer of a run folder shares: matplotlib without a window, its figures saved
alike, and how a number (or a missing one) appears in a Markdown table."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def fmt(v: Any, spec: str = ".3f") -> str:
    """``v`` for a report table: ``"-"`` for None, floats with ``spec``, anything else as ``str``."""
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)
