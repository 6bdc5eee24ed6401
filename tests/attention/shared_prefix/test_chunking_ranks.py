"""Rank-consistent grid plans: two processes (gloo) sharing an FSDP2-sharded model, with batches of
different shapes (one rank with a single group), agree on the number of model calls -- no hang
(a hard timeout fails the test) -- and give the repeated-prefix reference's log-probs, entropies and
FSDP-reduced gradients (float64). The ranks' work is in ``_attention_ranks_worker.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from multirank import run_ranks

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    return run_ranks(HERE / "_attention_ranks_worker.py", tmp_path_factory.mktemp("ranks"), timeout=240)


@pytest.mark.parametrize(
    "case", ["single_group_vs_split", "replan_and_pad", "default_options", "padding_free_vs_grid"]
)
def test_ranks_agree_on_model_calls_and_equal_the_reference(ranks, case):  # type: ignore[no-untyped-def]
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["plan"]["model_calls"] == r1["plan"]["model_calls"]
    for r in (r0, r1):
        calls = 1 if r["plan"]["layout"] == "padding_free" else r["plan"]["chunks"]
        assert calls + r["plan"]["empty_calls"] == r["plan"]["model_calls"]
        assert r["logprob_diff"] < 1e-10 and r["entropy_diff"] < 1e-10
        assert r["grad_diff"] < 1e-10 * max(1.0, r["grad_norm"])
    if case == "single_group_vs_split":  # rank 0 has one group: one grid, the rest empty calls
        assert r0["plan"]["chunks"] == 1 and r0["plan"]["empty_calls"] == r1["plan"]["chunks"] - 1 > 0
    if case == "replan_and_pad":  # rank 0 re-planned into more grids than it would alone
        assert r1["plan"]["chunks"] > 3 and r0["plan"]["chunks"] == 3 and r0["plan"]["empty_calls"] > 0
    if case == "padding_free_vs_grid":  # the layouts differ, the number of model calls does not
        assert r0["plan"]["layout"] == "padding_free" and r0["plan"]["empty_calls"] == 2
        assert r1["plan"]["layout"] == "grid" and r1["plan"]["chunks"] == 3
