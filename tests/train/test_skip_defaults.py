"""What ``grpo-parts train`` does about prompt skipping when the config does not say
(``grpo_parts.train.skip_defaults``): opt-in, with one line on finite data saying so (and why this
config could not take it, where it could not), and ``history`` with this door's measured settings
under the given ones and skipping's unbiased loss."""

from __future__ import annotations

import pytest

from grpo_parts.train.config import TrainConfig, load_config
from grpo_parts.train.skip_defaults import (
    EVIDENCE,
    SKIP_DEFAULT_AGG,
    TRAIN_HISTORY_KWARGS,
    finite_data,
    skip_notes,
)

FINITE = [{"task.train_size": 48}, {"data": "problems.jsonl"}]


def test_skipping_is_off_on_the_built_in_stream() -> None:
    """A fresh problem every step: no prompt comes back, so nothing could ever be skipped."""
    cfg = load_config()
    assert not finite_data(cfg) and cfg.parts.prompt_skip == "none" and cfg.parts.prompt_skip_kwargs == {}
    assert cfg.loss.agg == "token-mean" and skip_notes(cfg) == []


@pytest.mark.parametrize("overrides", FINITE, ids=["pool", "data_file"])
def test_skipping_is_opt_in_on_finite_data_and_the_run_says_so(overrides: dict[str, object]) -> None:
    cfg = load_config(overrides=overrides)
    assert finite_data(cfg) and cfg.parts.prompt_skip == "none" and cfg.loss.agg == "token-mean"
    (line,) = skip_notes(cfg)
    assert line.startswith("parts.prompt_skip: off (opt-in: ") and EVIDENCE in line
    assert line.endswith("--set parts.prompt_skip=history turns it on") and "\n" not in line
    off = load_config(overrides={**overrides, "parts.prompt_skip": "none"})
    assert off.parts.prompt_skip == "none" and skip_notes(off) == []  # the user said so: nothing to add


@pytest.mark.parametrize(
    "sets",
    [["loss.agg=token-mean"], ["advantage.norm=batch"]],
    ids=["token_mean_given", "batch_norm"],
)
def test_the_line_says_where_this_config_could_not_take_skipping(sets: list[str]) -> None:
    cfg = load_config(overrides=FINITE[0], sets=sets)
    assert cfg.parts.prompt_skip == "none"
    (line,) = skip_notes(cfg)
    assert ", though not with this config: " in line and "expected" in line and "\n" not in line


def test_history_behind_this_door_takes_the_measured_settings_under_the_given_ones() -> None:
    assert TRAIN_HISTORY_KWARGS == {
        "keep_base": 0.3,
        "base_step": 0.02,
        "target_share": 0.15,
        "step_size": "fill",
    }
    on = load_config(sets=["parts.prompt_skip=history"])
    assert on.parts.prompt_skip_kwargs == TRAIN_HISTORY_KWARGS and on.parts.filter == "cppo"
    given = load_config(sets=["parts.prompt_skip=history", "parts.prompt_skip_kwargs={step_size: fewer}"])
    assert given.parts.prompt_skip_kwargs == {**TRAIN_HISTORY_KWARGS, "step_size": "fewer"}


def test_skipping_on_says_which_loss_it_trains() -> None:
    (line,) = skip_notes(load_config(sets=["parts.prompt_skip=history"]))
    assert line.startswith(f"parts.prompt_skip='history': loss.agg='{SKIP_DEFAULT_AGG}', norm_constant=320")
    (given,) = skip_notes(load_config(sets=["parts.prompt_skip=history", "loss.agg=seq-mean-token-mean"]))
    assert given == "parts.prompt_skip='history': loss.agg='seq-mean-token-mean'"


def test_a_saved_config_reloads_as_it_ran() -> None:
    """config.yaml holds the decided settings: a resumed run trains the same parts and loss."""
    cfg = load_config(sets=["parts.prompt_skip=history", "parts.prompt_skip_kwargs={min_keep_prob: 0.2}"])
    again = TrainConfig.model_validate(cfg.model_dump(mode="json"))
    assert again.parts == cfg.parts and again.loss == cfg.loss
    assert cfg.with_reference_parts().parts.prompt_skip == "none"
