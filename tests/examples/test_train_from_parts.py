"""examples/train_from_parts.py runs (one step) and stays under 60 lines."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_from_parts.py"


def test_example_is_short() -> None:
    assert len(EXAMPLE.read_text().splitlines()) <= 60


def test_example_runs_one_step(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "1"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "step 0: held-out accuracy" in out and "step 1: reward" in out
