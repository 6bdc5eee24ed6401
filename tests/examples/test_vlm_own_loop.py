"""examples/vlm_own_loop.py: a vision-language policy's GRPO loop through the public API learns, its
training forward runs the vision tower once per prompt, not once per completion, on one process and
on two DDP ranks (gloo) holding different image counts. A hang fails after the timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm_own_loop.py"


def run(cmd: list[str]) -> dict[str, Any]:
    out = Path(cmd[-1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def check(records: list[dict[str, Any]], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:  # the shared-prefix forward ran (a grid), each prompt's images once
        assert r["attention_layout"] == "grid"
        assert 0 < r["tower_patches"] < r["tower_patches_repeated"], r


def test_vlm_own_loop_learns_with_each_image_once_per_group(tmp_path: Path) -> None:
    data = run([sys.executable, str(EXAMPLE), "--json", str(tmp_path / "vlm.json")])
    (records,) = data["ranks"]
    check(records, 40)
    first = sum(r["reward"] for r in records[:5]) / 5
    last = sum(r["reward"] for r in records[-10:]) / 10
    assert last > first + 0.2, (first, last)  # the reward rises: the policy learned from the images


def test_vlm_own_loop_two_ranks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
    ]
    data = run([*launcher, str(EXAMPLE), "--steps", "4", "--json", str(tmp_path / "vlm.json")])
    assert data["world_size"] == 2
    for rank, records in enumerate(data["ranks"]):
        assert {r["rank"] for r in records} == {rank}
        check(records, 4)
    # the ranks held different shapes: their image patches differ on some step
    assert any(a["tower_patches_repeated"] != b["tower_patches_repeated"] for a, b in zip(*data["ranks"]))
