"""GRPOPartsTrainer with a vision-language policy on two DDP processes (gloo, CPU), TRL's real
``train()`` (``_trl_vlm_ranks_worker.py``): each rank holds other prompts and images. With the same
scripted completions the shared-prefix backend's all-reduced gradients equal stock TRL's at both
optimizer steps; with every part on, every part ran on both ranks and nothing fell back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from multirank import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("trl_vlm_ranks")
    ranks = run_ranks(HERE / "_trl_vlm_ranks_worker.py", out, timeout=300)
    errors = {k: v for r in ranks for k, v in r["errors"].items()}
    if errors:
        pytest.fail("\n\n".join(f"{k}:\n{v}" for k, v in errors.items()))
    return ranks


def test_gradients_equal_stock_trl_on_two_ranks(ranks: list[dict[str, Any]]) -> None:
    import torch

    for r in ranks:
        stock, parts = r["runs"]["stock"]["grads"], r["runs"]["attention"]["grads"]
        assert len(stock) == len(parts) == 2
        for a, b in zip(stock, parts):
            assert a.keys() == b.keys() and any("visual" in n for n in a)
            scale = max(float(g.abs().max()) for g in a.values())
            for n, g in a.items():  # float32, TRL's fused LM head: relative to the largest gradient
                assert float((b[n] - g).abs().max()) <= 1e-5 * scale, n
        assert not r["runs"]["attention"]["reasons"]
    # the ranks held different images: their first steps' local batches differ, their grads agree
    torch.testing.assert_close(
        ranks[0]["runs"]["attention"]["grads"][0], ranks[1]["runs"]["attention"]["grads"][0]
    )


def test_every_part_ran_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        run = r["runs"]["every"]
        assert all(run["totals"][p] > 0 for p in ("sampler", "attention", "filter")), run["totals"]
        assert not run["reasons"], run["reasons"]
