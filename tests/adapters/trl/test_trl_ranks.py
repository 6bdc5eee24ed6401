"""GRPOPartsTrainer (shared-prefix attention) against stock TRL on two processes (gloo, CPU) under
accelerate's DeepSpeed ZeRO-3 / ZeRO-2 engine and DDP, gradient accumulation 2 (``_trl_ranks_worker.py``).

TRL hands ``_get_per_token_logps_and_entropies`` the module accelerate prepared (``DeepSpeedEngine``,
``DistributedDataParallel``; under DeepSpeed the reference model gets an engine too). The backend
inspects the transformers model inside and calls it through that wrapper: the engine's forward is
what makes ZeRO-3 accumulate micro-batches (calling the inner model gave a grad norm of 0.84 instead
of 1.35 here), DDP's is what all-reduces the gradients (without it each rank kept its own). Before,
the backend got the wrapper itself and refused it at the first forward.

Each rank holds other prompts (other widths), and with ``mask_truncated_completions`` rank 0 has a
group with nothing to score: fewer live rows (fewer chunks) in the no-grad forwards, and a
micro-batch with no completion token at all. Every rank must make the same model calls (ZeRO-3
gathers parameters in each forward, the backend agrees on its plan by all-reduce): rank 0 pads with
an empty call, and both ranks run TRL's own forward for that micro-batch (before, the ranks' calls
went out of step: a collective error or a hang). Per case: the full gradient of every parameter at
both optimizer steps, the logged losses and grad norms, every parameter after training, the
counters and the backend calls of each rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

from multirank import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
ALL_MASKED = (
    "a batch whose every completion is masked (mask_truncated_completions) on this or another "
    "data-parallel rank: every rank runs TRL's own forward for it"
)
WRAPPER = {"zero3": "DeepSpeedEngine", "zero2": "DeepSpeedEngine", "ddp": "DistributedDataParallel"}


def _launch(tmp_path_factory: Any, *cases: str) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("trl_ranks")
    ranks = run_ranks(HERE / "_trl_ranks_worker.py", out, list(cases), timeout=420)
    errors = {k: v for r in ranks for k, v in r["errors"].items()}
    if errors:
        pytest.fail("\n\n".join(f"{k}:\n{v}" for k, v in errors.items()))
    return ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory, "zero3")  # ~30 s


@pytest.fixture(scope="module")
def ranks_slow(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory, "ddp", "zero2")


def _check(ranks: list[dict[str, Any]], case: str) -> None:
    widths = [{s[1][1] for s in r["runs"][case, True]["shapes"]} for r in ranks]
    assert widths[0] != widths[1]  # the ranks hold different shapes
    for r in ranks:
        on, off = r["runs"][case, True], r["runs"][case, False]
        assert on["wrapped"] == off["wrapped"] == WRAPPER[case]
        # the calls went through the backend: policy (with grad), old-policy and reference log-probs
        assert {grad for grad, _ in on["shapes"]} == {True, False}
        steps = [log for log in on["logs"] if "loss" in log]
        assert len(steps) == 2
        # step 1: old-policy + reference + one micro-batch; the other micro-batch (rank 0's
        # truncated group, and rank 1's at the same step) runs TRL's forward on both ranks
        assert [s["parts/attention/forwards"] for s in steps] == [3, 1]
        assert [s["parts/attention/fallbacks"] for s in steps] == [1, 1]
        assert on["reasons"] == {"attention": [ALL_MASKED]}
        for ls, lo in zip([log for log in off["logs"] if "loss" in log], steps):
            assert lo["loss"] == pytest.approx(ls["loss"], rel=1e-5, abs=1e-7)
            assert lo["grad_norm"] == pytest.approx(ls["grad_norm"], rel=1e-5)
        assert len(on["grads"]) == len(off["grads"]) == 2
        for k, (g_on, g_off) in enumerate(zip(on["grads"], off["grads"])):
            assert g_on.keys() == g_off.keys() and max(g.abs().max().item() for g in g_off.values()) > 1e-3
            for name, g in g_off.items():
                torch.testing.assert_close(
                    g_on[name], g, atol=1e-6, rtol=1e-5, msg=lambda m, n=name, k=k: f"step {k}, {n}: {m}"
                )
        for name, p in off["params"].items():
            torch.testing.assert_close(
                on["params"][name], p, atol=1e-7, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
    # equally many backend calls on both ranks: rank 0 has fewer live rows to score without grad
    # (one chunk, rank 1 two) and pads with an empty call (one 1-token row)
    calls = [r["runs"][case, True]["calls"] for r in ranks]
    assert len(calls[0]) == len(calls[1]) > 0
    assert (1, 1) in calls[0] and (1, 1) not in calls[1]
    # every rank ends with the same parameters (one data-parallel update)
    for name, p in ranks[0]["runs"][case, True]["params"].items():
        torch.testing.assert_close(ranks[1]["runs"][case, True]["params"][name], p, atol=0, rtol=0)


def test_two_ranks_zero3_equal_stock_trl(ranks: list[dict[str, Any]]) -> None:
    _check(ranks, "zero3")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp", "zero2"])
def test_two_ranks_equal_stock_trl(ranks_slow: list[dict[str, Any]], case: str) -> None:
    _check(ranks_slow, case)
