"""Start-up timing of the speculative sampler (``sampler/speculative/calibration.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.sampler.speculative.calibration import _best_times, calibration_context
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler

from .test_decode_attention import _policy  # a GQA llama (2 KV heads for 4 query heads)


def test_context_grows_as_rows_finish() -> None:
    ctx = calibration_context(128, 100, 320, None, 6)
    lens = [ctx(a) for a in (128, 64, 16, 1)]
    assert lens == sorted(lens)  # fewer active rows: later in the rollout, longer caches
    assert 100 <= lens[0] <= 103 and 410 <= lens[-1] <= 420
    assert calibration_context(1, 100, 320, None, 6)(1) == 260  # a lone row: half-way
    win = calibration_context(128, 100, 320, 200, 6)
    assert 180 <= max(win(a) for a in range(1, 129)) <= 200 - 2 - 6  # inside the sliding window


def test_cells_are_timed_in_turn_and_long_ones_once() -> None:
    order: list[str] = []

    def cell(name: str, seconds: float) -> Callable[[], None]:
        def run() -> None:
            order.append(name)
            time.sleep(seconds)

        return run

    best = _best_times([cell("short", 0.0), cell("long", 0.03)], 3)
    assert order == ["short", "long", "short", "short"]  # passes in turn; the long cell ran once
    assert best[1] >= 0.03 > best[0]


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_times_the_decode_loops_attention(mode: str) -> None:
    """The start-up cost table is timed on the forwards the decode loop runs: the shared-prompt path
    at >= 64 rows of >= 4 per group, the grouped GQA path below (this policy has 2 KV heads for 4
    query heads), nothing of the kernel when it is off -- and the policy's attention is restored."""
    policy = _policy("sdpa")
    params = SamplingParams(group_size=8, max_new_tokens=8, temperature=1.0)
    cfg = SpeculativeConfig(max_draft_tokens=2, decode_shared_prompt=mode, calibrate_repeats=1)
    spec = SpeculativeSampler(policy, NGramDraft(max_ngram=3), cfg)
    cost = spec.calibrate(64, 12, params, prompt_len=6)
    calls = cost.calibration_calls
    if mode == "auto":
        # (``plain`` counts every call off the shared path; ``plain_gqa`` those of them served grouped)
        assert calls["shared_prefix"] > 0 and calls["plain"] == calls["plain_gqa"] > 0
    else:
        assert sum(calls.values()) == 0
    assert all(0 < t for row in cost.verify.values() for t in row)
    assert policy.config._attn_implementation == "sdpa"
