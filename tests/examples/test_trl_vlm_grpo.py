"""examples/trl_vlm_grpo.py runs as a TRL VLM user would run it: two steps, every part it turns on
counted (sampler, attention, filter), nothing fell back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_vlm_grpo.py"


def test_trl_vlm_example_runs_every_part(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("trl_vlm_grpo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--steps", "2", "--output-dir", str(tmp_path)])
    assert len(out["rewards"]) == 2
    for key in ("parts/sampler/rollouts", "parts/attention/forwards", "parts/filter/calls"):
        assert out["counters"][key] > 0, key
    assert all(v == 0 for k, v in out["counters"].items() if k.endswith("/fallbacks"))
