"""OpenRLHF's real step with DeepSpeed ZeRO-2 and ZeRO-3 on two processes (gloo, CPU), the grpo_parts
policy actor (shared prefix, grouped micro-batches) vs OpenRLHF's own.

Each rank trains on its own share of CPPO-kept experiences (rank 0: one prompt group; rank 1: two,
other lengths), and the backend splits each call into as many grids as it has groups, so the ranks
need different numbers of grids: they agree on the number of model calls (ZeRO-3 gathers
parameters in every forward; a disagreement hangs, and a hard timeout fails the test). One launch
runs every case (``_openrlhf_ranks_worker.py``), padded and ``--ds.packing_samples``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _openrlhf_ranks_worker import CASES
from multirank import run_ranks

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    pytest.importorskip("ray")
    return run_ranks(
        HERE / "_openrlhf_ranks_worker.py", tmp_path_factory.mktemp("openrlhf_ranks"), timeout=420
    )


def _runs(ranks, stage, packing):  # type: ignore[no-untyped-def]
    return [(r["step"][stage, packing, True], r["step"][stage, packing, False]) for r in ranks]


@pytest.mark.parametrize(
    "stage,packing", CASES, ids=[f"zero{s}-{'packed' if p else 'padded'}" for s, p in CASES]
)
def test_two_ranks_forward_objective_and_agreement(ranks, stage, packing):  # type: ignore[no-untyped-def]
    runs = _runs(ranks, stage, packing)
    assert runs[0][0]["kept_prompts"] == ["prompt 0"] and len(runs[1][0]["kept_prompts"]) == 2
    for on, off in runs:
        assert on["micro_batches"] == off["micro_batches"] == 4  # 2 updates x 2
        for (p, a), (q, b) in zip(on["old_logprobs"], off["old_logprobs"]):
            assert p == q
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)
        assert on["objective"] == pytest.approx(off["objective"], abs=1e-6) and on["objective"] != 0
        assert on["counters"]["parts/attention/forwards"] > 0
        assert on["counters"]["parts/attention/fallbacks"] == 0
    (on0, _), (on1, _) = runs
    assert len(on0["plans"]) == len(on1["plans"]) > 0
    assert [p["model_calls"] for p in on0["plans"]] == [p["model_calls"] for p in on1["plans"]]
    # rank 0 holds one prompt group (cut into sub-groups by completion length), rank 1 two: their grid
    # counts differ, and the rank with fewer pads with empty calls
    assert max(p["chunks"] for p in on1["plans"]) == 2 and max(p["model_calls"] for p in on0["plans"]) >= 2
    assert any(p["empty_calls"] for p in on0["plans"] + on1["plans"])


@pytest.mark.parametrize(
    "stage,packing", CASES, ids=[f"zero{s}-{'packed' if p else 'padded'}" for s, p in CASES]
)
def test_two_ranks_updates_equal_openrlhf(ranks, stage, packing):  # type: ignore[no-untyped-def]
    """Two updates (two epochs over the experiences, two micro-batches each): every parameter's full
    gradient before each optimizer step, the grad norm and every parameter afterwards."""
    for on, off in _runs(ranks, stage, packing):
        assert len(on["grads"]) == len(off["grads"]) == 2
        for k, (g_on, g_off) in enumerate(zip(on["grads"], off["grads"])):
            assert max(g.abs().max().item() for g in g_off.values()) > 1e-3
            for name, g in g_off.items():
                torch.testing.assert_close(
                    g_on[name], g, atol=1e-6, rtol=1e-5, msg=lambda m, n=name, k=k: f"update {k}, {n}: {m}"
                )
        assert on["status"]["actor_grad_norm"] == pytest.approx(off["status"]["actor_grad_norm"], rel=1e-5)
        moved = max((p - off["params_before"][n]).abs().max().item() for n, p in off["params"].items())
        assert moved > 1e-3
        for name, p in off["params"].items():
            torch.testing.assert_close(
                on["params"][name], p, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
