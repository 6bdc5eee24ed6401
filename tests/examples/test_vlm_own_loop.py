"""examples/vlm_own_loop.py: a vision-language policy's GRPO loop through the public API learns, and
its training forward runs the vision tower once per prompt, not once per completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm_own_loop.py"


def test_vlm_own_loop_learns_with_each_image_once_per_group(tmp_path: Path) -> None:
    out = tmp_path / "vlm.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert len(records) == 40
    first = sum(r["reward"] for r in records[:5]) / 5
    last = sum(r["reward"] for r in records[-10:]) / 10
    assert last > first + 0.2, (first, last)  # the reward rises: the policy learned from the images' count
    for r in records:  # the shared-prefix forward ran (a grid), each prompt's images once
        assert r["attention_layout"] == "grid"
        assert 0 < r["tower_patches"] < r["tower_patches_repeated"], r
