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
        assert on["micro_batches"] == off["micro_batches"] == 2
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


ZERO3 = (
    "ZeRO-3: the grpo_parts actor's gradient differs from OpenRLHF's (grad norm 1.28 vs 1.89 here) with "
    "one rank too and with the repeated-prefix backend, i.e. neither the grids nor the ranks; forward and "
    "objective agree. Open (the adapter refuses ZeRO-3; the worker bypasses the refusal), see "
    "docs/adapters/openrlhf.md"
)
UPDATE_CASES = [
    c if c[0] == 2 else pytest.param(*c, marks=pytest.mark.xfail(strict=True, reason=ZERO3)) for c in CASES
]


@pytest.mark.parametrize(
    "stage,packing", UPDATE_CASES, ids=[f"zero{s}-{'packed' if p else 'padded'}" for s, p in CASES]
)
def test_two_ranks_update_equals_openrlhf(ranks, stage, packing):  # type: ignore[no-untyped-def]
    for on, off in _runs(ranks, stage, packing):
        assert on["status"]["actor_grad_norm"] == pytest.approx(off["status"]["actor_grad_norm"], rel=1e-5)
        moved = max((p - off["params_before"][n]).abs().max().item() for n, p in off["params"].items())
        assert moved > 1e-3
        for name, p in off["params"].items():
            torch.testing.assert_close(
                on["params"][name], p, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_zero3_with_attention_is_refused():  # type: ignore[no-untyped-def]
    """Until the ZeRO-3 gradient difference above is found, the adapter refuses the combination."""
    from types import SimpleNamespace

    from grpo_parts_adapters.openrlhf.ray_actors import use_parts_backend

    from grpo_parts.errors import NotSupportedError

    args = SimpleNamespace(
        ds=SimpleNamespace(zero_stage=3),
        grpo_parts=SimpleNamespace(attention="shared_prefix"),
    )
    with pytest.raises(NotSupportedError, match="zero_stage 3"):
        use_parts_backend(SimpleNamespace(model=torch.nn.Linear(1, 1)), args, "policy")
