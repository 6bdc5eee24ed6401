"""The main job: `grpo-parts train` with no arguments (slow: minutes; run with `pytest -m slow`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from grpo_parts.cli import main


@pytest.mark.slow
def test_default_run_learns_the_builtin_task_within_ten_minutes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    assert main(["train", "--name", "default", "--no-progress", "-q"]) == 0
    elapsed = time.perf_counter() - t0
    run = tmp_path / "runs" / "default"
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert summary["initial_accuracy"] <= 0.30
    assert summary["final_accuracy"] >= 0.60
    assert elapsed <= 600
    for f in ("metrics.jsonl", "report.md", "accuracy.png", "step_time.png", "acceptance.png"):
        assert (run / f).is_file()


def test_shipped_warm_start_starts_low_but_not_at_zero(tmp_path: Path) -> None:
    """The committed policy is the starting point the default run needs: wrong mostly, right sometimes."""
    import torch

    from grpo_parts.sampler.protocol import SamplingParams
    from grpo_parts.sampler.reference import ReferenceSampler
    from grpo_parts.task.arithmetic import ArithmeticTask
    from grpo_parts.task.data import eval_accuracy
    from grpo_parts.train.lifecycle.setup import builtin_model_path, eos_ids, load_model

    torch.set_num_threads(1)
    model, tok = load_model(builtin_model_path(), torch.float32, torch.device("cpu"))
    task = ArithmeticTask()
    probs = task.eval_problems()[:128]
    eos = eos_ids(model, tok)
    greedy = SamplingParams(
        max_new_tokens=28, temperature=0.0, eos_token_ids=eos, pad_token_id=tok.pad_token_id
    )
    sampled = greedy.model_copy(update={"temperature": 1.0})
    gen = torch.Generator().manual_seed(0)

    class Seeded(ReferenceSampler):
        def generate(self, prompts, params, generator=None):  # type: ignore[no-untyped-def]
            return super().generate(prompts, params, gen)

    assert eval_accuracy(ReferenceSampler(model), task, probs, tok, greedy) <= 0.30
    assert eval_accuracy(Seeded(model), task, probs, tok, sampled) > 0.0  # GRPO needs some reward
