"""vLLM sampler settings without vLLM installed: the draft-length table's validation and what
reaches vLLM's ``speculative_config``, and the online draft's requirements (one line each)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from grpo_parts.sampler.vllm import OnlineDraftConfig, VLLMConfig, VLLMSpeculative, check_k_table


def test_explicit_table_reaches_vllm() -> None:
    spec = VLLMSpeculative(method="ngram", num_speculative_tokens=4, k_per_batch_size=[(1, 8, 4), (9, 64, 1)])
    cfg = spec.to_vllm(256)
    assert cfg["num_speculative_tokens_per_batch_size"] == [(1, 8, 4), (9, 64, 1)]
    assert cfg["num_speculative_tokens"] == 4


def test_disable_above_batch_is_a_two_range_table() -> None:
    spec = VLLMSpeculative(method="ngram", num_speculative_tokens=2, disable_above_batch=4)
    assert spec.table(16) == [(1, 4, 2), (5, 16, 0)]
    assert spec.table(4) is None  # never more than 4 rows in flight: the static length
    assert "num_speculative_tokens_per_batch_size" not in VLLMSpeculative(method="ngram").to_vllm(16)


@pytest.mark.parametrize(
    "table, needle",
    [
        ([(2, 8, 1)], "start at batch size 1"),
        ([(1, 4, 1), (6, 8, 0)], "start at batch size 5"),
        ([(1, 4, 9)], "0 <= k <= num_speculative_tokens=3"),
        ([(1, 4, 1), (3, 8, 0)], "start at batch size 5"),
        ([], "at least one range"),
    ],
)
def test_bad_tables_are_refused_with_the_field(table: list, needle: str) -> None:
    assert any(needle in r for r in check_k_table(table, 3))
    with pytest.raises(ValidationError, match="k_per_batch_size"):
        VLLMSpeculative(method="ngram", k_per_batch_size=table)


def test_one_way_to_size_the_draft() -> None:
    with pytest.raises(ValidationError, match="expected one of disable_above_batch"):
        VLLMSpeculative(method="ngram", disable_above_batch=4, k_schedule="cost_model")


def test_online_draft_needs_the_draft_model_method() -> None:
    with pytest.raises(ValidationError, match="online_draft: expected speculative.method='draft_model'"):
        VLLMConfig(speculative=VLLMSpeculative(method="ngram"), online_draft=OnlineDraftConfig())
    with pytest.raises(ValidationError, match="online_draft"):
        VLLMConfig(online_draft=OnlineDraftConfig())
