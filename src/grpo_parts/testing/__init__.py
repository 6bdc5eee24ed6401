"""A public testing kit for sampler and draft authors: enumerate a tiny model's exact sequence
distribution and chi-square test samples against it (:mod:`.distributions`; ``from
grpo_parts.testing import chi_square_gof``). No product module imports it. The deliberately broken
verifiers that prove the losslessness tests have teeth, and the door tests' fixtures, live with the
tests (tests/oracles.py, tests/door_fixtures.py)."""

from __future__ import annotations

from .distributions import (
    chi_square_gof,
    decode_sequences,
    encode_sequences,
    processed_probs,
    record_proposals,
    sequence_distribution,
)

__all__ = [
    "chi_square_gof",
    "decode_sequences",
    "encode_sequences",
    "processed_probs",
    "record_proposals",
    "sequence_distribution",
]
