"""A public testing kit for sampler and draft authors: exact sequence distributions of a tiny model
and a chi-square test against them (:mod:`.distributions`). No product module imports it; the broken
verifiers and door fixtures live with the tests (tests/oracles.py, tests/door_fixtures.py).
"""

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
