"""verl's real FSDP engine on two processes (gloo, CPU), the shared-prefix part on vs off.

The ranks hold different data (rank 0 a single ``uid`` group, rank 1 parts of three groups with
long-tailed completions), so their micro-batches split into different numbers of backend calls and
grids: the ranks agree on the number of model calls (FSDP gathers parameters in every forward and
reduces gradients in every backward; a disagreement hangs, and a hard timeout fails the test).
Per case (``fsdp``/``fsdp2``, fixed/dynamic micro-batches, remove-padding on/off, gradient
checkpointing on): log-probs and entropies, the losses and grad norms of two updates and every
rank's parameter shards after them equal verl's own forward to float32 tolerance; the part counters
say every micro-batch of every rank went through grpo_parts. One launch runs every case
(``_verl_ranks_worker.py``); FSDP1's accelerator-only ``sync_module_states`` check is skipped on CPU
(``_cpu_verl.verl_on_cpu``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
pytest.importorskip("transfer_queue")

from _verl_ranks_worker import CASES  # noqa: E402
from multirank import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    res = run_ranks(HERE / "_verl_ranks_worker.py", tmp_path_factory.mktemp("verl_ranks"), timeout=420)
    for r in res:
        assert not r["errors"], r["errors"]
    return res


def _id(case) -> str:  # type: ignore[no-untyped-def]
    strategy, dynamic, rmpad, options = case
    opts = dict(options)
    tail = "-grids" if "chunk_overhead_tokens" in opts else ""
    if opts.get("layout") == "padding_free":
        tail = "-padding_free" + ("-masked" if opts.get("varlen") is False else "-varlen")
    return f"{strategy}-{'dynamic' if dynamic else 'fixed'}-{'rmpad' if rmpad else 'padded'}{tail}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_two_ranks_part_on_equals_off(ranks, case):  # type: ignore[no-untyped-def]
    runs = [r["cases"][case] for r in ranks]
    for rank, run in enumerate(runs):
        assert run["logprob_diff"] < 2e-5, rank
        assert run["infer_counters"]["parts/attention/forwards"] == run["infer_micro"] > 0
        assert run["infer_counters"]["parts/attention/fallbacks"] == 0
        for (loss_on, norm_on, counters), (loss_off, norm_off, _) in zip(
            run["steps"]["on"], run["steps"]["off"]
        ):
            assert loss_on == pytest.approx(loss_off, rel=1e-5, abs=1e-6)
            assert norm_on == pytest.approx(norm_off, rel=1e-4)
            assert counters["parts/attention/forwards"] > 0 and counters["parts/attention/fallbacks"] == 0
            assert counters["parts/attention/grid_tokens"] > 0
        first = run["steps"]["on"][0][2]
        assert (
            first["parts/attention/logprob_forwards"] > 0 and first["parts/attention/logprob_fallbacks"] == 0
        )
        on, off, before = run["params"]["on"], run["params"]["off"], run["before"]
        assert max(float((off[k] - before[k]).abs().max()) for k in off) > 1e-3  # two updates moved it
        assert max(float((on[k] - off[k]).abs().max()) for k in on) < 1e-4  # ... the same way
    # the ranks made the same number of backend calls, each with the same number of model calls
    p0, p1 = runs[0]["plans"], runs[1]["plans"]
    assert len(p0) == len(p1) > 0
    assert [p["model_calls"] for p in p0] == [p["model_calls"] for p in p1]
    opts = dict(case[3])
    if (
        "chunk_overhead_tokens" in opts
    ):  # one call per micro-batch, split into grids: rank 0 (one group) pads with empty calls
        assert max(p["chunks"] for p in p1) > 1 and max(p["empty_calls"] for p in p0) > 0
    if opts.get("layout") == "padding_free":  # the kernel asked for ran on every rank, the other never
        ran, other = ("calls_masked_sdpa", "calls_varlen_cascade")[
            :: 1 if opts.get("varlen") is False else -1
        ]
        for run in runs:
            counters = [run["infer_counters"]] + [c for _, _, c in run["steps"]["on"]]
            assert all(c.get(f"parts/attention/{ran}", 0) > 0 for c in counters), (ran, counters)
            assert not any(c.get(f"parts/attention/{other}", 0) for c in counters), (other, counters)
            assert all(c["parts/attention/padding_free_tokens"] > 0 for c in counters)
