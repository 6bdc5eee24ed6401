"""Run summaries: time to target (interpolated), final accuracy (mean of the last evaluations)."""

from __future__ import annotations

import pytest

from grpo_parts.train.reporting.metrics import final_accuracy, summarize, time_to_target


def _rows(curve: list[tuple[int, float, float]]) -> list[dict[str, float]]:
    rows = []
    for step, wall, acc in curve:
        r = {"step": step, "wall_time": wall, "eval_accuracy": acc}
        if step:
            r.update(time_step=1.0, time_rollout=0.5, time_training=0.4, time_other=0.1, reward=acc)
        rows.append(r)
    return rows


def test_time_to_target_interpolates_between_evaluations() -> None:
    rows = _rows([(0, 0.0, 0.1), (5, 10.0, 0.4), (10, 20.0, 0.8)])
    step, t = time_to_target(rows, 0.6)
    assert step == 10 and t == pytest.approx(15.0)
    assert time_to_target(rows, 0.9) == (None, None)
    assert time_to_target(rows, 0.05) == (0, 0.0)


def test_final_accuracy_is_the_mean_of_the_last_three_evaluations() -> None:
    rows = _rows([(0, 0.0, 0.1), (5, 1.0, 0.5), (10, 2.0, 0.6), (15, 3.0, 0.7), (20, 4.0, 0.8)])
    assert final_accuracy(rows) == pytest.approx(0.7)
    s = summarize(rows, 0.6)
    assert (s["initial_accuracy"], s["last_accuracy"], s["steps_to_target"]) == (0.1, 0.8, 10)
    assert s["time_to_target_s"] == pytest.approx(2.0)


def test_decode_path_shares_sum_the_steps_and_stay_none_without_counts() -> None:
    rows = _rows([(0, 0.0, 0.1), (5, 1.0, 0.5), (10, 2.0, 0.6)])
    assert summarize(rows, 0.6)["lean_forward_fraction"] is None  # no speculative decode loop ran
    rows[1].update(lean_forward_calls=30, model_forward_calls=0, decode_attention_shared_prefix_calls=3)
    rows[2].update(lean_forward_calls=0, model_forward_calls=10, decode_attention_plain_calls=1)
    s = summarize(rows, 0.6)
    assert s["lean_forward_fraction"] == pytest.approx(0.75)
    assert s["decode_attention_shared_fraction"] == pytest.approx(0.75)
