"""``parts.prompt_skip: history`` in ``grpo-parts train``: the config refuses what the skip cannot keep
unbiased (one line each), a run skips prompts with a zero-variance streak and says so in its
metrics, its checkpoint carries the history, and a resumed run matches an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.refill import FilledBatch
from grpo_parts.skip.draw import PromptDraw
from grpo_parts.skip.history import HistorySkipper
from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.checkpoint import load_checkpoint
from grpo_parts.train.lifecycle.run import resume_config, train
from grpo_parts.train.skip_defaults import SKIP_DEFAULT_AGG, TRAIN_HISTORY_KWARGS
from grpo_parts.train.step.minibatches import Minibatch
from grpo_parts.train.step.prompt_skip import skip_minibatches
from grpo_parts.types import Rollout

SKIP = {
    "parts.prompt_skip": "history",
    # the step keeps its prompt count (fill), so every step's prompts are comparable
    "parts.prompt_skip_kwargs": {"min_keep_prob": 0.2, "keep_base": 0.3, "step_size": "fill"},
    "loss.agg": "seq-mean-token-mean",
}
COMPARED = ("reward", "kept", "prompts", "data_pos", "loss", "prompts_drawn", "prompts_skipped",
            "skip_rollout_tokens_saved", "skip_history_size", "skip_keep_base", "skip_max_weight")  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["loss.agg=token-mean"],  # chosen explicitly: refused with the reason
            r"parts\.prompt_skip: 'history' with loss\.agg='token-mean': divides by the drawn batch's token count",
        ),
        (
            ["loss.agg=seq-mean-token-mean", "advantage.norm=batch"],
            r"parts\.prompt_skip: 'history' with advantage\.norm='batch'",
        ),
        (
            ["loss.agg=seq-mean-token-mean", "advantage.estimator=reinforce_plus_plus_baseline"],
            r"parts\.prompt_skip: 'history' with estimator 'reinforce_plus_plus_baseline': every group is scaled",
        ),
        (
            ["loss.agg=seq-mean-token-sum-norm"],
            r"without loss\.norm_constant: the normaliser depends on which rows were kept",
        ),
    ],
)
def test_config_refuses_what_skipping_cannot_keep_unbiased(sets: list[str], message: str) -> None:
    with pytest.raises(GRPOPartsError, match=message) as e:
        load_config(sets=["parts.prompt_skip=history", *sets])
    assert "\n" not in str(e.value) and str(e.value).startswith("invalid training config: parts.prompt_skip:")


def test_config_names_and_defaults() -> None:
    assert load_config().parts.prompt_skip == "none"
    with pytest.raises(
        GRPOPartsError,
        match=r"^invalid training config: parts\.prompt_skip: expected one of \['history', 'none'\] \(a prompt skipper\), got 'greso'$",
    ):
        load_config(sets=["parts.prompt_skip=greso"])
    cfg = load_config(
        sets=[
            "parts.prompt_skip=history",
            "loss.agg=seq-mean-token-mean",
            "parts.prompt_skip_kwargs={min_keep_prob: 0.05}",
        ]
    )
    assert cfg.parts.prompt_skip_kwargs == {**TRAIN_HISTORY_KWARGS, "min_keep_prob": 0.05}
    assert cfg.with_reference_parts().parts.prompt_skip == "none"


def test_skip_chunks_weigh_rows_by_their_prompt_and_normalise_by_the_drawn() -> None:
    """2 rolled-out prompts (of 5 drawn) x 2 rows; one chunk per prompt."""
    draw = PromptDraw(HistorySkipper(), iter([]), key=lambda x: x)
    from grpo_parts.skip.draw import SkipRound

    draw.rounds.append(SkipRound([7, 9], torch.tensor([2.0, 4.0], dtype=torch.float64), 5, [6, 8, 10]))
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    ones = torch.ones(4, 2, dtype=torch.long)
    ro = Rollout(ones, ones, ones, mask, torch.zeros(4, 2), torch.tensor([0, 0, 1, 1]), 2)
    filled = FilledBatch(
        rollout=ro, advantages=torch.zeros(4), kept=torch.arange(4), num_tokens=5.0, num_seqs=3.0,
        rewards=torch.zeros(4), prompts=[7, 9], outcome=None, full_group=torch.tensor([0, 0, 1, 1]),
    )  # type: ignore[arg-type]  # fmt: skip
    chunks = [Minibatch(torch.tensor([0, 1])), Minibatch(torch.tensor([2, 3]))]
    out = skip_minibatches(chunks, filled, draw, count_empty=True)
    assert [c.weights.tolist() for c in out] == [[2.0, 2.0], [4.0, 4.0]]  # type: ignore[union-attr]
    assert [c.num_seqs for c in out] == [2 * 2.5, 2 * 2.5]  # own rows x drawn / rolled out
    # counting only non-empty rows, a row without a token is refused (the drawn count is unknown)
    with pytest.raises(GRPOPartsError, match=r"^prompt skipping: a completion without a token"):
        skip_minibatches(chunks, filled, draw, count_empty=False)
    weighted = [Minibatch(torch.tensor([0, 1]), torch.tensor([1.0, 3.0]), 3.0, 2.0)]
    (w,) = skip_minibatches(weighted, filled, draw, count_empty=True)
    assert w.weights.tolist() == [2.0, 6.0] and w.num_seqs == 5.0 and w.num_tokens == 3.0  # type: ignore[union-attr]


def zero_variance_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 10-problem JSONL file whose prompts not starting with 1 always get reward 0 (zero
    variance: skippable from the second epoch on); the others are rewarded by text length."""
    from grpo_parts.task.jsonl import JsonlTask

    def reward(self: Any, text: str, problem: Any) -> float:
        return float(len(text) % 3 == 0) if problem.prompt.startswith("1") else 0.0

    monkeypatch.setattr(JsonlTask, "reward", reward)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(10))
    )
    return data


@pytest.fixture
def skip_run(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """``skip_run(name, steps) -> TrainResult`` on 10 problems (8 train) with the reference parts and
    ``history`` skipping; prompts not starting with 1 always get reward 0 (zero variance)."""
    data = zero_variance_data(tmp_path, monkeypatch)
    base = tiny_overrides(
        tiny_model_dir, tmp_path, data=str(data), eval_fraction=0.2, eval_every=50, max_new_tokens=4
    )
    base.pop("task.name")
    base.pop("task.num_eval")
    cfg = load_config(overrides=base).with_reference_parts()
    given = cfg.model_dump(mode="json", exclude_unset=True)
    assert "loss" not in given  # skipping is opt-in: each run below says its own loss

    def run(name: str, steps: int, default_loss: bool = False, fewer: bool = False) -> Any:
        skip = {k: v for k, v in SKIP.items() if not (default_loss and k == "loss.agg")}
        if fewer:  # this door's history settings, but the step rolls out only the kept prompts
            skip = {
                "parts.prompt_skip": "history",
                "parts.prompt_skip_kwargs": {"step_size": "fewer"},
                "loss.agg": "seq-mean-token-mean",
            }
        c = load_config(overrides={**given, **skip, "parts.filter": "keep_all"})
        return train(c.model_copy(update={"name": name, "steps": steps}))

    return run


def test_a_run_skips_streaks_reports_them_and_resumes_exactly(skip_run: Any) -> None:
    full = skip_run("full", 5)
    rows = [r for r in full.rows if r["step"] > 0]
    for r in rows:
        assert r["prompts"] == 3 and r["prompts_drawn"] >= 3 and r["skip_history_size"] > 0
        assert r["prompts_skipped"] == r["prompts_drawn"] - r["prompts"]
    assert sum(r["prompts_skipped"] for r in rows) > 0  # the second epoch skips some zero-variance prompts
    assert any(r["skip_rollout_tokens_saved"] > 0 and r["skip_max_weight"] > 1 for r in rows)
    _, ckpt = load_checkpoint(full.run_dir)
    assert (
        ckpt.state is not None and ckpt.state["prompt_skip"]["ids"].numel() == rows[-1]["skip_history_size"]
    )
    part = skip_run("part", 3)
    resumed = train(resume_config(part.run_dir, {"steps": 5}), run_dir=part.run_dir, resume=True)
    a = [r for r in full.rows if r["step"] == 5][0]
    b = [r for r in resumed.rows if r["step"] == 5][0]
    for k in COMPARED:
        assert a.get(k) == pytest.approx(b.get(k), rel=1e-6, abs=1e-9), k


def test_one_flag_on_the_default_loss_trains_unbiased_and_says_how(skip_run: Any) -> None:
    """``--set parts.prompt_skip=history`` alone: the default token-mean (whose drawn-batch token count
    is unknown for skipped prompts) becomes a token sum over a constant fixed before the draw
    (``max_new_tokens`` per row), written to config.yaml and said in one line; prompts are skipped."""
    run = skip_run("default_loss", 4, default_loss=True)
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert saved["loss"]["agg"] == SKIP_DEFAULT_AGG and saved["loss"]["norm_constant"] == 4
    (note,) = [n for n in (run.run_dir / "report.md").read_text().splitlines() if "parts.prompt_skip=" in n]
    assert "norm_constant=4 (a normaliser fixed before the draw" in note
    assert sum(r["prompts_skipped"] for r in run.rows if r["step"] > 0) > 0


def test_step_size_fewer_rolls_out_only_the_kept_prompts(skip_run: Any) -> None:
    """``step_size: fewer`` over this door's other history settings (written to config.yaml): a step
    draws its 3 prompts and rolls out only those it keeps."""
    run = skip_run("fewer", 5, fewer=True)
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert saved["parts"]["prompt_skip_kwargs"] == {**TRAIN_HISTORY_KWARGS, "step_size": "fewer"}
    rows = [r for r in run.rows if r["step"] > 0]
    assert sum(r["prompts_skipped"] for r in rows) > 0
    assert all(r["prompts_drawn"] == 3 and r["prompts"] == 3 - r["prompts_skipped"] for r in rows)


def test_the_default_loss_under_skipping_is_the_dr_grpo_constant() -> None:
    cfg = load_config(sets=["parts.prompt_skip=history"])
    assert cfg.loss.agg == SKIP_DEFAULT_AGG and cfg.loss.norm_constant == cfg.max_new_tokens
    assert load_config().loss.agg == "token-mean"  # skipping off: the default stays
    kept = load_config(sets=["parts.prompt_skip=history", "loss.agg=seq-mean-token-mean"])
    assert kept.loss.agg == "seq-mean-token-mean" and kept.loss.norm_constant is None


@pytest.mark.parametrize("flag", [["--set", "parts.prompt_skip=history"], []], ids=["flag", "default"])
def test_the_command_on_a_data_file_exits_0_and_skips_only_when_asked(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: list[str]
) -> None:
    """The issue's command, ``grpo-parts train --data FILE --set parts.prompt_skip=history``: exit 0,
    ``prompts_skipped > 0`` in metrics.jsonl; the same without the flag skips nothing (opt-in,
    docs/results.md "The finite-data default"). Prompts not starting with 1 always get reward 0."""
    from grpo_parts.cli import main

    data = zero_variance_data(tmp_path, monkeypatch)
    argv = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out-dir", str(tmp_path), "--name", "r",
            "--steps", "6", "--no-progress", "--set", "prompts_per_step=3", "--set", "group_size=4",
            "--set", "max_new_tokens=4", "--set", "threads=1", "--set", "eval_every=50",
            "--set", "eval_fraction=0.2", "--set", "stop_after_flat=0", *flag]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    skipped = sum(r.get("prompts_skipped", 0) for r in rows if r["step"] > 0)
    assert skipped > 0 if flag else skipped == 0
