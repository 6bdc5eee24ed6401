"""grpo_parts.distributed on one process (no process group): nothing to agree with. Several ranks:
tests/attention/shared_prefix/test_wrapped_ranks.py and the adapters' two-rank tests."""

from __future__ import annotations

from grpo_parts.distributed import agree_max, agree_on_calls, ranks_of


def test_rank_helpers_on_one_process() -> None:
    assert ranks_of() == 1
    assert agree_max([3, 1]) == [3, 1]
    assert agree_on_calls(2) == 2
