"""``--compare --arms``: the filter and prompt-skipping arms side by side (train/experiments/arms.py), and the
finite multi-epoch variant of the reasoning task (``task.train_size``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.task.reasoning import ReasoningConfig, ReasoningTask
from grpo_parts.train.config import TrainConfig, load_config
from grpo_parts.train.experiments.arms import ARMS, GRESO, arm_configs, arm_summary
from grpo_parts.train.skip_defaults import SKIP_DEFAULT_AGG, STRONG_RULE, TRAIN_HISTORY_KWARGS

EVERY = ["keep_all", "cppo", "dppo", "cppo+skip", "dppo+skip"]


def test_arms_change_only_the_filter_and_skipping_and_share_one_loss() -> None:
    cfg = load_config()
    arms = arm_configs(cfg, EVERY)
    p = {a: c.parts for a, c in arms.items()}
    assert [p[a].filter for a in EVERY] == ["keep_all", "cppo", "dppo", "cppo", "dppo"]
    assert [p[a].prompt_skip for a in EVERY] == ["none", "none", "none", "history", "history"]
    assert p["dppo"].refill_rounds == p["dppo+skip"].refill_rounds == 0  # a weighted filter never refills
    for c in arms.values():  # sampler and attention as configured; one loss (skipping's) for every arm
        assert (c.parts.sampler, c.parts.attention) == (cfg.parts.sampler, cfg.parts.attention)
        assert c.loss.agg == SKIP_DEFAULT_AGG and c.loss.norm_constant == cfg.max_new_tokens
    no_skip = arm_configs(cfg, ["keep_all", "cppo"])
    assert all(c.loss == cfg.loss for c in no_skip.values())  # no skipping arm: the loss as configured
    assert set(ARMS) >= {"reference", "optimized", *EVERY}
    with pytest.raises(GRPOPartsError, match=r"^--arms: expected names from \["):
        arm_configs(cfg, ["greso"])


def test_skip_on_and_off_arms_train_what_a_user_who_says_only_that_gets() -> None:
    cfg = load_config(overrides={"task.train_size": 48})  # finite data (skipping opt-in)
    arms = arm_configs(cfg, ["skip_on", "skip_off", "cppo+skip"])
    on, off = arms["skip_on"], arms["skip_off"]
    assert on.parts.prompt_skip == "history" and on.parts.prompt_skip_kwargs == TRAIN_HISTORY_KWARGS
    assert on.loss.agg == SKIP_DEFAULT_AGG  # skipping's default loss
    assert off.parts.prompt_skip == "none" and off.loss.agg == "token-mean"  # the loss skipping off trains
    assert on.parts.filter == off.parts.filter == cfg.parts.filter
    pinned = arm_configs(
        load_config(overrides={"task.train_size": 48, "loss.agg": "seq-mean-token-mean"}), ["skip_off"]
    )
    assert pinned["skip_off"].loss.agg == "seq-mean-token-mean"  # a given loss stays


def test_fewer_arms_roll_out_only_the_kept_prompts_over_the_configured_skip_settings() -> None:
    cfg = load_config(
        overrides={"parts.prompt_skip": "history", "parts.prompt_skip_kwargs": {"min_keep_prob": 0.2}}
    )
    arms = arm_configs(
        cfg, ["cppo", "cppo+skip", "cppo+skip_fewer", "dppo+skip_fewer", "keep_all+skip_fewer"]
    )
    assert arms["cppo"].parts.prompt_skip == "none" and arms["cppo"].parts.prompt_skip_kwargs == {}
    # every skip arm pins GRESO's rule or the strong one and how a skip pays, whatever the door's
    # default history settings are; the configured settings it does not pin stay
    assert arms["cppo+skip"].parts.prompt_skip_kwargs == {"min_keep_prob": 0.2, **GRESO, "step_size": "fill"}
    for a in ("cppo+skip_fewer", "dppo+skip_fewer", "keep_all+skip_fewer"):
        assert arms[a].parts.prompt_skip_kwargs == {"min_keep_prob": 0.2, **GRESO, "step_size": "fewer"}
    more = arm_configs(cfg, ["cppo+skip_posterior", "cppo+skip_strong", "cppo+skip_strong_fewer"])
    assert more["cppo+skip_posterior"].parts.prompt_skip_kwargs == {
        "min_keep_prob": 0.2, **GRESO, "step_size": "fill", "rule": "posterior"
    }  # fmt: skip
    assert more["cppo+skip_strong"].parts.prompt_skip_kwargs == {
        "min_keep_prob": 0.2,
        **STRONG_RULE,
        "step_size": "fill",
    }
    # the strong, filling arm is this door's default history settings
    assert more["cppo+skip_strong"].parts.prompt_skip_kwargs == {"min_keep_prob": 0.2, **TRAIN_HISTORY_KWARGS}
    assert more["cppo+skip_strong_fewer"].parts.prompt_skip_kwargs == {
        "min_keep_prob": 0.2,
        **STRONG_RULE,
        "step_size": "fewer",
    }
    assert GRESO == {"keep_base": 0.5, "base_step": 0.01, "target_share": 0.25}  # the paper's rule


def test_an_explicit_token_mean_loss_with_a_skipping_arm_is_refused_before_any_run() -> None:
    cfg = load_config(sets=["loss.agg=token-mean"])
    with pytest.raises(Exception, match="parts.prompt_skip: 'history' with loss.agg='token-mean'"):
        arm_configs(cfg, ["cppo", "cppo+skip"])


def test_finite_reasoning_task_goes_over_the_same_problems_each_epoch_in_a_new_order() -> None:
    task = ReasoningTask(ReasoningConfig(train_size=6), seed=1)
    epochs = [[task.train_problem(e * 6 + i).prompt for i in range(6)] for e in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and len(set(epochs[0])) == 6
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled
    infinite = ReasoningTask(ReasoningConfig(), seed=1)
    assert len({infinite.train_problem(i).prompt for i in range(18)}) > 6
    assert TrainConfig(task={"name": "reasoning", "train_size": 6}).task.train_size == 6  # type: ignore[union-attr]


def test_arm_summary_counts_tokens_to_target_and_shares() -> None:
    rows: list[dict[str, Any]] = [
        {"step": 0, "eval_accuracy": 0.1, "wall_time": 0.0},
        {"step": 1, "time_step": 1.0, "wall_time": 1.0, "rollout_tokens": 100, "zero_variance_share": 0.5, "reward": 0.2,
         "prompts": 4, "prompts_drawn": 6, "prompts_skipped": 2},
        {"step": 2, "time_step": 1.0, "wall_time": 2.0, "rollout_tokens": 80, "zero_variance_share": 0.25, "reward": 0.3,
         "prompts": 4, "prompts_drawn": 4, "prompts_skipped": 0, "eval_accuracy": 0.7},
        {"step": 3, "time_step": 1.0, "wall_time": 3.0, "rollout_tokens": 50, "zero_variance_share": 0.0, "reward": 0.4,
         "prompts": 4, "prompts_drawn": 5, "prompts_skipped": 1},
    ]  # fmt: skip
    s = arm_summary(rows, target=0.6)
    assert s["steps_to_target"] == 2 and s["rollout_tokens_to_target"] == 180 and s["rollout_tokens"] == 230
    assert s["zero_variance_share"] == pytest.approx(0.25) and s["prompts_skipped_share"] == pytest.approx(
        3 / 15
    )


def test_compare_arms_runs_them_alternating_and_reports(tmp_path: Path, tiny_compare: Any) -> None:
    rc, res = tiny_compare("--arms", "keep_all", "dppo", "dppo+skip", "--seeds", "2")
    assert rc == 0 and list(res["arms"]) == ["keep_all", "dppo", "dppo+skip"] and res["seeds"] == [0, 1]
    for arm in res["arms"].values():
        assert arm["rollout_tokens"] > 0 and arm["zero_variance_share"] is not None
    folder = tmp_path / "cmp"
    assert (folder / "arms_seeds.md").read_text().startswith("# Arms compared")
    for seed in (0, 1):
        assert {p.name for p in (folder / f"seed{seed}").iterdir()} >= {
            "keep_all",
            "dppo",
            "dppo+skip",
            "arms.png",
        }
    rows = (folder / "seed0" / "dppo+skip" / "metrics.jsonl").read_text()
    assert '"prompts_drawn"' in rows and '"zero_variance_share"' in rows


def test_arms_flag_needs_compare(capsys: pytest.CaptureFixture[str]) -> None:
    from grpo_parts.cli import main

    assert main(["train", "--arms", "cppo", "--steps", "1"]) != 0
    assert "--arms: only used with --compare, got it without" in capsys.readouterr().err


def test_a_seed_that_misses_the_target_counts_as_never_in_the_median() -> None:
    """Dropping the seeds that missed would report an arm that reached the target once as if it
    always did: a miss is +inf, so two misses in three leave no median."""
    from grpo_parts.train.experiments.arms import aggregate_arms

    def seed(steps: float | None) -> dict[str, Any]:
        t = None if steps is None else steps * 2.0
        return {
            "target_accuracy": 0.8,
            "arms": {"a": {"steps_to_target": steps, "time_to_target_s": t, "final_accuracy": 0.8}},
        }

    one_miss = aggregate_arms([seed(10), seed(None), seed(20)], [0, 1, 2])["arms"]["a"]
    assert one_miss["steps_to_target"] == 20 and one_miss["time_to_target_s"] == 40
    assert one_miss["seeds_reached"] == 2 and one_miss["final_accuracy"] == 0.8
    two_miss = aggregate_arms([seed(10), seed(None), seed(None)], [0, 1, 2])["arms"]["a"]
    assert two_miss["steps_to_target"] is None and two_miss["seeds_reached"] == 1
