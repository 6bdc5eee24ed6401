"""The public distribution-testing kit (src/grpo_parts/testing/distributions.py): its goodness-of-fit
test accepts draws from the law and rejects draws from another, and a sample in a category of
probability 0 is never explained by luck."""

from __future__ import annotations

import numpy as np

from grpo_parts.testing import chi_square_gof


def test_chi_square_gof_accepts_the_law_and_rejects_another() -> None:
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    same = rng.choice(4, size=4000, p=probs)
    other = rng.choice(4, size=4000, p=[0.4, 0.4, 0.15, 0.05])
    assert chi_square_gof(same, probs) > 1e-3
    assert chi_square_gof(other, probs) < 1e-6


def test_a_sample_where_the_law_has_no_mass_fails_outright() -> None:
    assert chi_square_gof([0, 1, 2, 3], np.array([0.5, 0.5, 0.0, 0.0])) == 0.0
