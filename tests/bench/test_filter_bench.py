"""The filter bench's JSON contract (keys per point), on a very small configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_parts.bench.filter import amdahl
from grpo_parts.cli import main


def test_bench_json_keys(tmp_path: Path) -> None:
    out = tmp_path / "filter.json"
    argv = ["bench", "filter", "--json", str(out), "--prompts", "2", "--group-size", "4", "--prompt-len", "6"]
    argv += ["--completion-len", "8", "--hidden", "32", "--layers", "1", "--vocab", "64", "--repeats", "1"]
    argv += ["--micro-batch", "2", "--rates", "0.5", "0.75"]
    assert main(argv) == 0
    points = json.loads(out.read_text())
    assert [p["pruning_rate"] for p in points] == [0.0, 0.5, 0.75]
    for p in points:
        assert {"pruning_rate", "speedup", "ideal"} <= set(p)
        assert p["ideal"] == pytest.approx(1 / (1 - p["pruning_rate"]))
        assert p["kept_rows"] == 8 - int(p["pruning_rate"] * 8)


def test_amdahl() -> None:
    assert amdahl(4.0, 0.0) == pytest.approx(4.0)
    assert amdahl(4.0, 0.9) == pytest.approx(1 / (0.9 + 0.1 / 4))
    assert amdahl(1e9, 0.65) == pytest.approx(1 / 0.65)
