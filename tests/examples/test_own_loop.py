"""examples/own_loop.py: a plain PyTorch GRPO loop over the four parts, on two DDP ranks (gloo, CPU)
and on one process. A hang (a collective one rank never reaches) fails after the timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"
TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def check_rank(records: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # the loss falls: every update lowers its own batch's GRPO loss (never raises it), and some step
    # had something to learn (a group with mixed rewards kept by CPPO)
    for r in records:
        assert r["loss_after"] <= r["loss"] + 1e-6, r
    assert sum(r["loss_after"] - r["loss"] for r in records) < -1e-3, records
    assert any(r["reward"] > 0 for r in records)
    # the speculative sampler ran its lean decode forward, the shared-prefix attention computed the
    # training log-probs (two calls a step: the update and the loss after it)
    assert all(r["lean_forward_calls"] > 0 for r in records)
    assert all(r["decode_attention_shared_prefix_calls"] > 0 for r in records)
    assert sum(records[-1]["attention_layout_counts"].values()) == 2 * len(records)


def test_own_loop_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    # torchrun through this interpreter: a `torchrun` found on PATH may belong to another venv (the
    # floor suite's ranks ran the dev venv's python)
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    run([*launcher, "--nproc_per_node", "2", "--master_port", str(free_port()), str(EXAMPLE),
         "--steps", "4", "--json", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and len(data["ranks"]) == 2
    for rank, records in enumerate(data["ranks"]):
        assert {r["rank"] for r in records} == {rank}
        check_rank(records)


def test_own_loop_one_process(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    run([sys.executable, str(EXAMPLE), "--steps", "4", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["world_size"] == 1
    check_rank(data["ranks"][0])
