"""Wrapped policies in the public API, two gloo processes on CPU (``_wrapped_ranks_worker.py``): the
shared-prefix and reference backends take the policy *wrapped* -- DDP, FSDP1, FSDP2, accelerate's
prepared model, DeepSpeed ZeRO-2 -- inspect the inner model and run every forward through the
wrapper, so its gradient reduction happens: after two micro-batches (the first under ``no_sync``)
the gradients equal the average of each rank's single-process reference gradient (float64, 1e-10
relative to the largest gradient norm). The ranks hold batches of different shapes and agree on
their number of model calls (rank 0 pads with empty calls); nothing hangs (a hard timeout). The
reference sampler generates from the wrapped policy as from the bare model, sharded ranks stepping
together while one has finished."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from multirank import run_ranks

HERE = Path(__file__).resolve().parent
TORCH_KINDS = ["ddp", "fsdp1", "fsdp2"] + (["accelerate"] if importlib.util.find_spec("accelerate") else [])
#: what each kind's wrapper reports (grpo_parts.wrappers.wrapper_kind; FSDP2 is no wrapper)
#: DeepSpeed's ZeRO optimizer keeps its gradient partitions in float32 (its master precision), so a
#: float64 policy's reduced gradient is float32-exact there (a missing reduction is off by O(1))
TOL = {"zero2": 1e-6}
WRAPPER = {"ddp": "DDP", "fsdp1": "FSDP1", "fsdp2": "FSDP", "accelerate": "DDP", "zero2": "DeepSpeed"}


@pytest.fixture(scope="module")
def torch_ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    return run_ranks(
        HERE / "_wrapped_ranks_worker.py",
        tmp_path_factory.mktemp("wrapped"),
        [",".join(TORCH_KINDS)],
        timeout=300,
    )


def check_kind(ranks: list[dict[str, Any]], kind: str) -> None:
    r0, r1 = ranks[0][kind], ranks[1][kind]
    assert WRAPPER[kind] in r0["wrapper"]
    for name in ("shared_prefix", "reference"):
        for r in (r0, r1):
            res = r[name]
            assert res["missing_grads"] == []
            assert res["logprob_diff"] < 1e-10 and res["entropy_diff"] < 1e-10
            assert res["grad_diff"] < TOL.get(kind, 1e-10) * max(1.0, res["grad_norm"]), (kind, name, res)
    # the ranks agreed on their model calls per micro-batch; rank 0 (one group) padded with empty calls
    for p0, p1 in zip(r0["shared_prefix"]["plans"], r1["shared_prefix"]["plans"]):
        assert p0["model_calls"] == p1["model_calls"] > 1
        assert p0["chunks"] == 1 and p0["empty_calls"] == p0["model_calls"] - 1 > 0
        assert p1["chunks"] + p1["empty_calls"] == p1["model_calls"]
    s0, s1 = r0["sampler"], r1["sampler"]
    for s in (s0, s1):
        assert s["completion_equal"] and s["logprob_diff"] < 1e-10
    assert s0["steps"] == 1 and s1["steps"] == 6  # rank 0's rows ended at their first token
    if s0["lockstep"]:  # sharded: rank 0 ran one-token forwards while rank 1 decoded
        assert s0["forwards"] == s1["forwards"] == 6
    else:  # whole weights: each rank decodes on its own, with the inner model
        assert (s0["forwards"], s1["forwards"]) == (1, 6) and not s0["calls_wrapper"]
    assert s0["lockstep"] == (kind in ("fsdp1", "fsdp2"))
    assert s0["calls_wrapper"] == (kind == "fsdp1")  # FSDP1's forward unshards: through the wrapper


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_wrapped_policy_gradients_equal_the_average_of_the_ranks(torch_ranks, kind):  # type: ignore[no-untyped-def]
    check_kind(torch_ranks, kind)


@pytest.mark.frameworks
def test_deepspeed_zero2_engine(tmp_path):  # type: ignore[no-untyped-def]
    """DeepSpeed's engine (ZeRO-2, torch's AdamW with lr 0, two micro-batches of gradient
    accumulation) on CPU, as tests/adapters/openrlhf runs it."""
    pytest.importorskip("deepspeed")
    ranks = run_ranks(HERE / "_wrapped_ranks_worker.py", tmp_path, ["zero2"], timeout=300)
    check_kind(ranks, "zero2")
