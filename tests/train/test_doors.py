"""Door parity, embedded trainer (issue 38, docs/doors.md): ``grpo-parts train`` runs every
optimization of the table on a tiny Llama policy, and its ``metrics.jsonl`` counts each one. A change
that makes the trainer silently lose one (as TRL's rollouts lost the lean decode forward and the
shared-prompt decode attention) fails here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from door_fixtures import (
    COMPLETION_TOKENS,
    REFUSAL_COUNTERS,
    SAMPLER_COUNTERS,
    missing,
    sampler_kwargs,
)

from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import train
from grpo_parts.train.reporting.metrics import read_metrics


def _step(tmp_path: Path, **over: Any) -> dict[str, Any]:
    """The one training step's metrics row of a run of the built-in reasoning task and its warm start
    (``tiny_reasoner``, a Llama): 4 prompts x 4 completions, CPPO with one refill round, the
    padding-free attention layout."""
    base: dict[str, Any] = {
        "out_dir": str(tmp_path), "name": "doors", "steps": 1, "prompts_per_step": 4, "group_size": 4,
        "max_new_tokens": COMPLETION_TOKENS, "eval_every": 100, "task.name": "reasoning", "task.num_eval": 1,
        "threads": 1, "progress": False, "stop_after_flat": 0, "parts.refill_rounds": 1, "parts.filter_kwargs": {"pruning_rate": 0.5},
        "parts.attention_kwargs": {"layout": "padding_free"}, "parts.sampler_kwargs": sampler_kwargs(),
    }  # fmt: skip
    base.update(over)
    run = train(load_config(overrides=base))
    (row,) = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "reward" in r]
    return row


def test_every_optimization_runs_and_is_counted(tmp_path: Path) -> None:
    """n-gram draft: the lean decode forward, the shared-prompt decode attention, speculation chosen
    by the cost model, the padding-free layout's varlen kernel, CPPO with refill; nothing refused."""
    row = _step(tmp_path)
    keys = {k: v for k, v in SAMPLER_COUNTERS.items() if k not in ("draft trees", "online draft training")}
    keys.update({"padding-free layout (varlen)": "calls_varlen_cascade", "refill": "rounds"})
    assert missing(row, keys) == {}, row
    assert row["rounds"] == 2 and 0 < row["kept_fraction"] < 1  # CPPO pruned, one refill round
    assert all(row[k] == 0 for k in REFUSAL_COUNTERS), row
    assert row["model_forward_calls"] == 0  # every decode forward was lean


@pytest.mark.parametrize("draft", ["eagle"])
def test_trees_and_online_draft_training(tmp_path: Path, draft: str) -> None:
    """An online EAGLE draft (trained by the loop after each rollout) drafting 4-node trees."""
    row = _step(
        tmp_path, **{"parts.draft": draft, "parts.sampler_kwargs": sampler_kwargs(trees=True),
                     "parts.refill_rounds": 0, "parts.attention_kwargs": {}},
    )  # fmt: skip
    keys = {k: SAMPLER_COUNTERS[k] for k in ("lean decode forward", "draft trees", "online draft training")}
    assert missing(row, keys) == {}, row
    assert all(row[k] == 0 for k in REFUSAL_COUNTERS), row
