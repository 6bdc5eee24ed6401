"""Helpers for tests only; no product module imports this package.

* :mod:`.distributions` -- enumerate a tiny model's exact sequence distribution and chi-square test
  samples against it (re-exported here: ``from grpo_parts.testing import chi_square_gof``);
* :mod:`.oracles` -- deliberately **broken** verifiers that tests use to prove the losslessness tests
  have teeth (``from grpo_parts.testing.oracles import always_accept``).
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
