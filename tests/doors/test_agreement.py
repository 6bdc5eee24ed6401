"""The fallback-and-agree step after a shared-prefix plan (``grpo_parts.doors.agreement``); the
several-rank agreement runs in tests/adapters/*/test_*_ranks.py."""

from __future__ import annotations

from grpo_parts.doors.agreement import agree_fallback


def test_one_process_keeps_its_own_decision() -> None:
    assert agree_fallback(None, 3, None, None, other="another rank") == (None, 3)
    assert agree_fallback("no layout", 1, None, None, other="another rank") == ("no layout", 1)
