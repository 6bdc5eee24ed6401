"""Shared test settings: float64 CPU equivalence, derandomized hypothesis, small shapes."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

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
