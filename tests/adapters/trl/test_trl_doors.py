"""Door parity, TRL (issue 38, docs/doors.md): ``GRPOPartsTrainer`` under TRL 1.16's default
configuration (bf16 autocast: accelerate wraps the policy's forward; gradient checkpointing: a hook
on the embedding; TRL's fused LM head on the forward; the shared-prefix training kernel selected for
the whole training step, inside which TRL generates) runs every optimization of the table on a tiny
Llama policy, and TRL's logged metrics count each one. Before issue 38 the rollouts ran neither the
lean decode forward nor the shared-prompt decode attention, and nothing said so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from door_fixtures import (  # noqa: E402
    COMPLETION_TOKENS,
    REFUSAL_COUNTERS,
    SAMPLER_COUNTERS,
    missing,
    reasoning_problems,
    reasoning_reward,
    sampler_kwargs,
    tiny_reasoner,
)
from grpo_parts_adapters.trl import GRPOPartsTrainer  # noqa: E402

S = "parts/sampler/"


def _step(tmp_path: Path, **parts: Any) -> tuple[Any, dict[str, Any]]:
    """One training step, 4 prompts x 4 completions of the reasoning task, TRL's defaults otherwise
    (bf16, gradient checkpointing, dapo): ``(trainer, the step's logged metrics)``."""
    from datasets import Dataset
    from transformers import set_seed
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=16,
        num_generations=4, max_completion_length=COMPLETION_TOKENS, max_steps=1, logging_steps=1,
        disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    assert args.bf16 and args.gradient_checkpointing
    set_seed(0)
    model, tok = tiny_reasoner()
    prompts, answers = reasoning_problems(32)
    tr = GRPOPartsTrainer(
        model=model, reward_funcs=reasoning_reward, args=args, processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}), **parts,
    )  # fmt: skip
    tr.train()
    (log,) = [h for h in tr.state.log_history if "loss" in h]
    return tr, log


def test_every_optimization_runs_and_is_counted(tmp_path: Path) -> None:
    """n-gram draft: the lean decode forward, the shared-prompt decode attention, speculation chosen
    by the cost model, the padding-free layout's varlen kernel, CPPO with refill; nothing refused."""
    tr, log = _step(
        tmp_path, sampler="speculative", draft="ngram", sampler_kwargs=sampler_kwargs(),
        attention="shared_prefix", attention_kwargs={"layout": "padding_free"},
        filter="cppo", filter_kwargs={"pruning_rate": 0.5},
        parts={"refill_rounds": 1},  # one extra round
    )  # fmt: skip
    keys = {
        k: S + v for k, v in SAMPLER_COUNTERS.items() if k not in ("draft trees", "online draft training")
    }
    keys.update(
        {"padding-free layout (varlen)": "parts/attention/calls_varlen_cascade", "CPPO": "parts/filter/calls",
         "refill": "parts/filter/rounds"}
    )  # fmt: skip
    assert missing(log, keys) == {}, log
    assert log["parts/filter/rounds"] == 2 and log["parts/filter/kept_fraction"] < 1
    assert all(log[S + k] == 0 for k in REFUSAL_COUNTERS), log
    assert log[S + "model_forward_calls"] == 0  # every decode forward was lean
    assert all(log[f"parts/{p}/fallbacks"] == 0 for p in ("sampler", "attention", "filter"))
    assert not tr._gp_counters.reasons


def test_trees_and_online_draft_training(tmp_path: Path) -> None:
    """An online EAGLE draft (trained by the sampler after each training rollout) drafting 4-node
    trees, through the same wrapped policy."""
    _, log = _step(tmp_path, sampler="speculative", draft="eagle", sampler_kwargs=sampler_kwargs(trees=True))
    keys = {
        k: S + SAMPLER_COUNTERS[k] for k in ("lean decode forward", "draft trees", "online draft training")
    }
    assert missing(log, keys) == {}, log
    assert all(log[S + k] == 0 for k in REFUSAL_COUNTERS), log
