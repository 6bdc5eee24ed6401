"""The reasoning-shaped task: a long shared instruction, long-tailed worked solutions, exact answers."""

from __future__ import annotations

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.task.reasoning import INSTRUCTION, ReasoningConfig, ReasoningTask, reduction_solution
from grpo_parts.task.tokenizer import build_char_tokenizer


def test_reduction_format() -> None:
    assert reduction_solution([3, 5, 2, 7]) == "8+2+7=10+7=17;17"
    assert reduction_solution([4, 4]) == "8;8"


@settings(derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=20))
def test_reward_grades_only_the_final_answer(terms: list[int]) -> None:
    task = ReasoningTask()
    p = task.problem(terms)
    assert task.terms(p) == terms
    assert task.reward(task.sft_target(p), p) == 1.0
    assert task.reward(f"wrong work;{sum(terms)}", p) == 1.0
    assert task.reward(f"{task.sft_target(p)}0", p) == 0.0


def test_shape_instruction_and_long_tail_in_every_batch() -> None:
    """Prompts: the same >= 64-token instruction + the problem. In every batch of 8 (and 16)
    consecutive stream problems the median solution is >= 48 tokens and the longest >= 4x it."""
    from grpo_parts.task.reasoning import CHARS

    tok = build_char_tokenizer(CHARS)
    assert len(tok.encode(INSTRUCTION).ids) >= 64
    task = ReasoningTask(seed=1)
    for width in (8, 16):
        for b in range(60):
            problems = [task.train_problem(i) for i in range(b * width, (b + 1) * width)]
            assert all(p.prompt.startswith(INSTRUCTION) for p in problems)
            lengths = [len(tok.encode(task.sft_target(p)).ids) + 1 for p in problems]  # + EOS
            med = statistics.median(lengths)
            assert med >= 48 and max(lengths) >= 4 * med, (b, lengths)


def test_stream_is_deterministic_and_held_out_is_disjoint() -> None:
    a = ReasoningTask(seed=3)
    assert [a.train_problem(i) for i in range(50)] == [
        ReasoningTask(seed=3).train_problem(i) for i in range(50)
    ]
    evals = a.eval_problems()
    assert evals == ReasoningTask(seed=9).eval_problems() and len(evals) == 200
    assert all(a.is_held_out(p.prompt) for p in evals)
    assert not any(a.is_held_out(a.train_problem(i).prompt) for i in range(300))
    assert sum(len(a.terms(p)) >= ReasoningConfig().long_min_terms for p in evals) == 200 // 8


def test_config_refuses_min_above_max() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="expected min <= max"):
        ReasoningConfig(min_terms=9, max_terms=7)


def test_the_built_in_warm_start_tokenizes_the_prompt_as_it_was_trained() -> None:
    """One token per character, spaces included (load_model uses the declared tokenizer class; plain
    AutoTokenizer on the shipped llama folder is tested in tests/test_tiny.py)."""
    import torch

    from grpo_parts.train.lifecycle.setup import builtin_model_path, load_model

    _, tok = load_model(builtin_model_path("reasoning"), torch.float32, torch.device("cpu"), progress=False)
    p = ReasoningTask().train_problem(0).prompt
    ids = tok(p).input_ids
    assert len(ids) == len(p) and tok.decode(ids) == p
