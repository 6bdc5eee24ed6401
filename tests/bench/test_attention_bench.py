"""The attention bench's ``--vlm`` workload and JSON keys, on a very small configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_parts.bench.attention import ideal_ratio
from grpo_parts.cli import main
from grpo_parts.compat import transformers_version


@pytest.mark.skipif(
    transformers_version() < (5, 0), reason="Qwen2-VL's forward takes no logits_to_keep before 5.0 (refused)"
)
def test_vlm_bench_json_keys(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    argv = ["bench", "attention", "--vlm", "--quick", "--json", str(out), "--hidden", "64", "--layers", "1"]
    argv += ["--heads", "2", "--kv-heads", "1", "--vocab", "64", "--repeats", "1"]
    assert main(argv) == 0
    (point,) = json.loads(out.read_text())
    keys = {"G", "P", "S", "image_tokens", "patches", "ideal", "ideal_with_tower", "speedup", "memory_ratio"}
    assert keys | {"max_abs_logprob_diff", "efficiency"} <= set(point)
    assert point["image_tokens"] == 256 and point["P"] == 256 + 2 + 2 * 16  # start/end tokens, text
    assert point["ideal"] == pytest.approx(ideal_ratio(8, point["P"], point["S"]), abs=1e-4)
    assert point["ideal_with_tower"] > point["ideal"]
    assert point["max_abs_logprob_diff"] < 1e-4  # float32: the two paths agree
