"""Shared test settings: float64 CPU equivalence, derandomized hypothesis, small shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings


def _test_threads() -> int:
    """GRPO_PARTS_TEST_THREADS (scripts/ci/test-install.sh runs two suites side by side, one thread
    each), else up to 2."""
    given = os.environ.get("GRPO_PARTS_TEST_THREADS", "")
    if not given:
        return max(1, min(2, os.cpu_count() or 1))
    if not given.isdigit() or int(given) < 1:
        raise pytest.UsageError(f"GRPO_PARTS_TEST_THREADS: got {given!r}, expected a whole number >= 1")
    return int(given)


torch.set_num_threads(_test_threads())

# derandomize=True: CI sees the same examples every run; deadline=None: torch timing is noisy.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "dev", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Tests that need a training framework (TRL, verl, OpenRLHF) or vLLM carry the ``frameworks`` marker:
# everything under tests/adapters/, and any module that sets ``pytestmark = pytest.mark.frameworks``
# (the vLLM modules of tests/sampler/vllm/ do; its test_config.py needs no vLLM and stays in the core
# suite). The "core suite" (``-m "not slow and not gpu and not frameworks"``) is what
# scripts/ci/test-install.sh runs under the newest and the floor transformers, where those frameworks
# (which pin older transformers) are not installed.
_FRAMEWORK_DIRS = ("adapters",)


def pytest_collection_modifyitems(config: object, items: list[pytest.Item]) -> None:
    tests_root = Path(__file__).resolve().parent
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(tests_root)
        if rel.parts and rel.parts[0] in _FRAMEWORK_DIRS:
            item.add_marker(pytest.mark.frameworks)
