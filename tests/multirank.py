"""Run a test worker script on several CPU processes (a gloo group of ``world`` ranks), with a hard
timeout: a rank that waits forever on a collective fails the test instead of hanging CI.

The worker is ``python SCRIPT OUT_DIR ARGS...`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` (``init_process_group("gloo")`` reads them) and writes ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    script: Path, out: Path, args: list[str] | None = None, *, world: int = 2, timeout: float = 300
) -> list[dict[str, Any]]:
    """Start ``world`` ranks of ``script``, wait at most ``timeout`` seconds for all of them (then kill
    them and fail: a hang), fail on a non-zero exit; return each rank's saved results."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        log = open(out / f"rank{r}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(script), str(out), *(args or [])]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    hung = False
    for p, _ in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    tails = "\n".join(
        f"--- rank {r} (exit {p.returncode}) ---\n" + (out / f"rank{r}.log").read_text()[-6000:]
        for r, (p, _) in enumerate(procs)
    )
    if hung:
        pytest.fail(f"ranks did not finish within {timeout:.0f} s (a hang?):\n{tails}")
    if any(p.returncode != 0 for p, _ in procs):
        pytest.fail(f"a rank failed:\n{tails}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
