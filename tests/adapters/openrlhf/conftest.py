"""OpenRLHF 0.11.2 on CPU: test-only stand-ins for its top-level ``flash_attn`` / ``vllm`` imports.

OpenRLHF imports ``flash_attn.bert_padding`` (packing helpers) and ``vllm`` (``SamplingParams``,
``TokensPrompt``) at module top; neither installs without CUDA. The stand-ins (``_openrlhf_standins.py``) exist only
while this package's tests run (installed by a package-scoped fixture, removed afterwards, and
only for names that do not import for real), so no other test sees them. The packing helpers are
plain-torch versions of flash_attn's (same signatures), enough for OpenRLHF's ``packing_samples``
path on CPU, where transformers' SDPA/eager attention separates packed sequences by position ids.
transformers' availability checks run before the stand-ins exist, and the stand-ins carry no
version, so transformers never believes flash-attn or vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _openrlhf_standins import install, uninstall


@pytest.fixture(scope="package", autouse=True)
def openrlhf_standins() -> Any:
    pytest.importorskip("deepspeed", reason="OpenRLHF needs a real deepspeed (scripts/ci/install-dev.sh)")
    if importlib.util.find_spec("openrlhf") is None:
        pytest.skip(
            "openrlhf not installed (pip install --no-deps openrlhf==0.11.2; see scripts/ci/install-dev.sh)"
        )
    installed = install()
    yield
    uninstall(installed)


HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_worker(script: str, out: Path, env: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    """Run ``script`` (in this folder) as ``python script OUT PORT`` offline; it writes
    ``OUT/results.pt``. Returns the results and the finished process; fails the test otherwise."""
    full = {
        **os.environ,
        "HF_DATASETS_CACHE": str(out / "hf_datasets"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / script), str(out), str(free_port())],
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not (out / "results.pt").exists():
        pytest.fail(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return torch.load(out / "results.pt", weights_only=False), proc


@pytest.fixture(scope="package")
def cpu_run(tmp_path_factory: Any) -> dict[str, Any]:
    """OpenRLHF's step and default-configuration run on CPU (``_ds_worker.py``), once per test session."""
    pytest.importorskip("ray")
    out = tmp_path_factory.mktemp("openrlhf_ds")
    res, proc = run_worker("_ds_worker.py", out, {"RAY_DEDUP_LOGS": "0"})
    res["log"] = proc.stdout + proc.stderr
    if res["errors"]:
        pytest.fail("\n\n".join(f"{k}:\n{v}" for k, v in res["errors"].items()))
    return res
