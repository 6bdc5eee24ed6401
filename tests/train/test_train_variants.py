"""``grpo-parts train`` with the GRPO variants: each policy loss runs the main job without NaN, the
estimators / KL in the reward / entropy bonus / rollout correction run through the loop, and bad
settings fail with one line naming the field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import train


@pytest.fixture
def dense_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward a random tiny policy earns half the time, so advantages are nonzero and the loss trains."""
    from grpo_parts.task.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, text, problem: float(len(text) % 2 == 0))


def _run(model_dir: Path, tmp_path: Path, tiny_overrides: Any, sets: list[str], name: str) -> list[dict]:
    base = tiny_overrides(model_dir, tmp_path, name=name, steps=2, eval_every=2)
    cfg = load_config(overrides=base, sets=sets).with_reference_parts()
    if any(s.startswith("parts.filter=") for s in sets):  # keep an explicitly chosen filter
        cfg = cfg.model_copy(update={"parts": cfg.parts.model_copy(update={"filter": "cppo"})})
    return train(cfg).rows


def _assert_finite(rows: list[dict], *keys: str) -> None:
    trained = [r for r in rows if r["step"] > 0]
    assert trained and all(r["kept"] > 0 for r in trained)
    for r in trained:
        for k in ("loss", "reward", *keys):
            assert r.get(k) is not None and math.isfinite(r[k]), (k, r.get(k))
    assert math.isfinite(rows[-1]["eval_accuracy"])


@pytest.mark.parametrize("policy", ["clip", "gspo", "gspo_token", "cispo", "sapo"])
def test_each_policy_loss_trains_without_nan(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, dense_reward: None, policy: str
) -> None:
    rows = _run(tiny_model_dir, tmp_path, tiny_overrides, [f"loss.policy={policy}"], policy)
    _assert_finite(rows, "clip_fraction")


def test_estimators_kl_entropy_and_correction_run_through_the_loop(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, dense_reward: None
) -> None:
    sets = [
        "advantage.estimator=reinforce_plus_plus_baseline",
        "advantage.kl_coef=0.05",
        "loss.entropy_coef=0.01",
        "loss.correction.level=token",
        "loss.correction.mode=mask",
        "loss.correction.low=0.5",
        "parts.filter=cppo",
    ]
    rows = _run(tiny_model_dir, tmp_path, tiny_overrides, sets, "everything")
    _assert_finite(rows, "entropy", "correction_mean")
    # the reference sampler is the training module: its log-probs equal the recomputed ones up to
    # float32 rounding, so the correction weights are 1 to that precision
    assert all(abs(r["correction_mean"] - 1.0) < 1e-4 for r in rows if r["step"] > 0)
    rows = _run(tiny_model_dir, tmp_path, tiny_overrides, ["advantage.estimator=rloo"], "rloo")
    _assert_finite(rows)


@pytest.mark.parametrize(
    "sets,field",
    [
        (["loss.policy=ppo2"], "loss.policy"),
        (["advantage.estimator=gae"], "advantage.estimator"),
        (["loss.policy=sapo", "loss.dual_clip=3"], "dual_clip"),
        (["advantage.estimator=rloo", "advantage.norm=none"], "norm"),
        (["loss.correction.level=token", "old_logprobs=sampler"], "loss.correction.level"),
        (["advantage.kl_coef=0.1", "advantage.kl_placement=token"], "advantage.kl_placement"),
        (["loss.correction.high=null"], "high"),
    ],
)
def test_bad_variant_config_is_one_line_naming_the_field(sets: list[str], field: str) -> None:
    with pytest.raises(GRPOPartsError) as info:
        load_config(sets=sets)
    lines = str(info.value).splitlines()
    assert len(lines) == 1 and field in lines[0], str(info.value)  # one problem, one line


def test_set_selects_variants() -> None:
    cfg = load_config(sets=["loss.policy=gspo", "advantage.estimator=rloo", "advantage.reward_clip=[-1, 1]"])
    assert (cfg.loss.policy, cfg.advantage.estimator, cfg.advantage.reward_clip) == (
        "gspo",
        "rloo",
        (-1.0, 1.0),
    )
