"""``--compare --ablate``: one arm per optimized part, and the composed (isolated) Amdahl prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from grpo_parts.train.config import REFERENCE_PARTS, TrainConfig
from grpo_parts.train.experiments.ablation import ablation_configs, isolated_bound


def test_each_arm_is_the_reference_with_one_part_swapped_in() -> None:
    cfg = TrainConfig(parts={"filter_kwargs": {"pruning_rate": 0.5}, "sampler_kwargs": {"draft_tokens": 3}})
    arms = ablation_configs(cfg)
    assert set(arms) == {"only_sampler", "only_attention", "only_filter"}
    p = {k: a.parts for k, a in arms.items()}
    assert (p["only_sampler"].sampler, p["only_sampler"].draft) == ("speculative", "ngram")
    assert p["only_sampler"].sampler_kwargs == {"draft_tokens": 3}
    assert (p["only_sampler"].attention, p["only_sampler"].filter) == ("reference", "keep_all")
    assert (p["only_attention"].sampler, p["only_attention"].attention) == ("reference", "shared_prefix")
    assert p["only_attention"].filter == "keep_all" and p["only_attention"].draft is None
    assert (p["only_filter"].filter, p["only_filter"].filter_kwargs) == ("cppo", {"pruning_rate": 0.5})
    assert p["only_filter"].sampler == "reference" and p["only_filter"].attention == "reference"
    for a in arms.values():  # everything but the parts is the run's own config
        assert a.model_copy(update={"parts": cfg.parts}) == cfg
    # a part the optimized config leaves at its reference gets no arm
    same = TrainConfig(parts={"attention": REFERENCE_PARTS["attention"]})
    assert set(ablation_configs(same)) == {"only_sampler", "only_filter"}


def _summary(step: float, final: float, **phases: float) -> dict[str, float]:
    keys = {"rollout": "mean_rollout_s", "logprobs": "mean_logprobs_s", "update": "mean_update_s"}
    return {"mean_step_s": step, "final_accuracy": final, "mean_draft_s": 0.0,
            **{keys[k]: v for k, v in phases.items()}}  # fmt: skip


def test_isolated_bound_multiplies_each_phases_isolated_ratios() -> None:
    sums = {
        "reference": _summary(10.1, 0.8, rollout=4.0, logprobs=2.0, update=4.0),  # other = 0.1
        "optimized": _summary(4.04, 0.78, rollout=2.0, logprobs=0.7, update=1.2),
        "only_sampler": _summary(8.1, 0.81, rollout=2.0, logprobs=2.0, update=4.0),
        "only_attention": _summary(7.1, 0.79, rollout=4.0, logprobs=1.0, update=2.0),
        "only_filter": _summary(7.1, 0.75, rollout=4.0, logprobs=1.0, update=1.0),
    }
    res = isolated_bound(sums, step_speedup=10.1 / 4.04)
    predicted = res["ablation"]["predicted_phases_s"]
    assert predicted == pytest.approx({"rollout": 2.0, "logprobs": 0.5, "update": 0.5, "draft": 0.0})
    assert res["amdahl_isolated"] == pytest.approx(10.1 / 3.1)
    assert res["composition"] == pytest.approx((10.1 / 4.04) / (10.1 / 3.1))
    arm = res["ablation"]["arms"]["only_filter"]
    assert arm["phase_ratios"]["update"] == pytest.approx(4.0) and arm["phase_ratios"]["draft"] is None
    assert arm["accuracy_diff"] == pytest.approx(-0.05) and arm["step_speedup"] == pytest.approx(10.1 / 7.1)


def test_compare_ablate_over_seeds_runs_every_arm(tmp_path: Path, tiny_compare: Any) -> None:
    rc, res = tiny_compare("--ablate", "--seeds", "2")
    assert rc == 0
    arms = {"only_sampler", "only_attention", "only_filter"}
    for r in (res, *res["per_seed"]):
        assert set(r["ablation"]["arms"]) == arms
        assert r["amdahl_isolated"] > 0 and r["composition"] > 0
    for r in res["per_seed"]:
        assert set(r["runs"]) == {"reference", "optimized", *arms}
        assert "speculative" in r["parts"]["only_sampler"] and "keep_all" in r["parts"]["only_sampler"]
    assert "composition_ge_0.8" in res["goals"]
    for seed in (0, 1):
        for arm in arms:  # each arm is a whole run folder, like the two main arms
            assert (tmp_path / "cmp" / f"seed{seed}" / arm / "metrics.jsonl").is_file()
    md = (tmp_path / "cmp" / "compare_seeds.md").read_text()
    assert "Each part alone" in md and "composition" in md
    assert "Each part alone" in (tmp_path / "cmp" / "seed0" / "compare.md").read_text()
