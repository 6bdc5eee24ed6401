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
from typing import Any

import pytest
from _openrlhf_standins import install, uninstall


@pytest.fixture(scope="package", autouse=True)
def openrlhf_standins() -> Any:
    pytest.importorskip("deepspeed", reason="OpenRLHF needs a real deepspeed (scripts/install-dev.sh)")
    if importlib.util.find_spec("openrlhf") is None:
        pytest.skip(
            "openrlhf not installed (pip install --no-deps openrlhf==0.11.2; see scripts/install-dev.sh)"
        )
    installed = install()
    yield
    uninstall(installed)
