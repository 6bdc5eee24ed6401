"""CPPO / zero-variance / refill with two data-parallel ranks in OpenRLHF (gloo, CPU, DeepSpeed ZeRO-2).

OpenRLHF filters in its single controller (the experience maker), on the global rollout, then cuts
the experience list into per-rank shares. The rollout's second half -- rank 1's share in plain
OpenRLHF -- is all zero-variance groups. Every case must give: the one-process decision (rounded to
whole ``--train.batch_size`` optimizer steps), equal shares, every kept row trained (none dropped by
OpenRLHF's ``drop_last`` loader), the same micro-batches and optimizer steps on both ranks, and
filter calls counted. A disagreement between the ranks hangs their collectives: a hard timeout
fails the test (``_openrlhf_filter_ranks_worker.py``, one launch for every case).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _openrlhf_filter_ranks_worker import CASES, REWARDS, TRAIN_BATCH, G
from multirank import run_ranks

from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.filter import get_filter_class
from grpo_parts.filter.rounding import round_kept_rows
from grpo_parts.types import ScoredBatch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    pytest.importorskip("ray")
    res = run_ranks(
        HERE / "_openrlhf_filter_ranks_worker.py", tmp_path_factory.mktemp("openrlhf_filter"), timeout=300
    )
    for r in res:
        assert not r["errors"], r["errors"]
    return res


def one_process(name: str) -> list[tuple[str, float]]:
    """What one process decides on the whole rollout: the filter, then the rounding."""
    filt, kwargs, rounding, _ = CASES[name]
    r = torch.tensor(REWARDS, dtype=torch.float32)
    gi = torch.arange(len(REWARDS) // G).repeat_interleave(G)
    adv = group_advantages(r, gi, AdvantageConfig(norm="group", unbiased_std=True, eps=1e-9))
    scored = ScoredBatch(r, adv, gi)
    kept = get_filter_class(filt)(**kwargs).select(scored).kept
    (kept,) = round_kept_rows([scored], [kept], TRAIN_BATCH, rounding)  # type: ignore[arg-type]
    return sorted((f"prompt {int(gi[i])}", round(float(r[i]), 6)) for i in kept.tolist())


@pytest.mark.parametrize("name", list(CASES))
def test_kept_rows_are_decided_once_balanced_and_fill_whole_steps(ranks, name):  # type: ignore[no-untyped-def]
    runs = [r["cases"][name] for r in ranks]
    kept = runs[0]["kept"]
    assert runs[1]["kept"] == kept  # the same controller decision
    n = len(kept)
    assert n > 0 and n % TRAIN_BATCH == 0
    if name != "cppo_refill":
        assert sorted((p, round(r, 6)) for p, r in kept) == one_process(name)
    for run in runs:
        assert run["share_rows"] == [n // 2, n // 2]
        assert sum(run["rows_trained"]) == n // 2  # no row dropped by the loader
        assert len(run["rows_trained"]) == len(runs[0]["rows_trained"])
        assert run["optimizer_steps"] == n // TRAIN_BATCH > 0
        assert run["filter_calls"] > 0


def test_the_cases_exercise_rounding_refill_and_the_zero_variance_half(ranks):  # type: ignore[no-untyped-def]
    cases = ranks[0]["cases"]
    signal = {"prompt 0", "prompt 1"}  # prompts 2 and 3 (plain OpenRLHF's rank-1 share) have none
    assert {p for p, _ in cases["zero_variance"]["kept"]} == signal
    assert cases["cppo_up"]["last_info"]["rounded_rows"] == 3  # k=5 -> 8
    assert cases["cppo_down"]["last_info"]["rounded_rows"] == -3  # k=7 -> 4
    refill = cases["cppo_refill"]
    assert refill["refill_calls"] and refill["last_info"]["rounded_rows"] == 2  # 4 + 2 kept -> 8
    assert any(p.startswith("refill") for p, _ in refill["kept"])
