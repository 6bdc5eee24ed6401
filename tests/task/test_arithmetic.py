"""The built-in task: problem stream, held-out split, worked solutions, exact-answer reward, tokenizer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from grpo_parts.task.arithmetic import ArithmeticConfig, ArithmeticTask, worked_solution
from grpo_parts.task.graders import after_delimiter
from grpo_parts.task.tokenizer import CHARS, EOS_ID, PAD_ID, build_char_tokenizer, build_hf_tokenizer


def test_worked_solution_format() -> None:
    assert worked_solution([17, 25, 9]) == "17+25=42,42+9=51;51"
    assert worked_solution([3, 4]) == "3+4=7;7"


@given(st.lists(st.integers(0, 999), min_size=2, max_size=6))
def test_reward_accepts_the_worked_solution_and_only_the_right_answer(ops: list[int]) -> None:
    task = ArithmeticTask(ArithmeticConfig(operands=len(ops), max_value=999))
    p = task.problem(ops)
    assert task.reward(task.sft_target(p), p) == 1.0
    assert task.reward(f"anything;{sum(ops) + 1}", p) == 0.0
    assert task.reward(str(sum(ops)), p) == 0.0  # no ';' -> no answer


def test_the_answer_is_after_the_last_semicolon() -> None:
    assert after_delimiter("1+2=3;4;5 ", ";") == "5"
    assert after_delimiter("12", ";") is None


def test_stream_is_deterministic_and_never_serves_held_out_problems() -> None:
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    probs = [a.train_problem(i) for i in range(300)]
    assert probs == [b.train_problem(i) for i in range(300)]
    assert probs != [ArithmeticTask(seed=4).train_problem(i) for i in range(300)]
    held = {p.prompt for p in a.eval_problems()}
    assert len(held) == a.config.num_eval
    assert not held & {p.prompt for p in probs}
    assert all(a.is_held_out(p) for p in held)
    assert ArithmeticTask(seed=9).eval_problems() == a.eval_problems()  # same held-out set for every seed


def test_char_tokenizer_round_trip() -> None:
    tok = build_char_tokenizer()
    text = "17+25=42,42+9=51;51"
    enc = tok.encode(text)
    assert len(enc.ids) == len(text)
    assert tok.decode(enc.ids) == text
    hf = build_hf_tokenizer()
    assert len(hf) == 3 + len(CHARS)
    assert (hf.pad_token_id, hf.eos_token_id) == (PAD_ID, EOS_ID)
    assert hf.decode(hf(text).input_ids + [EOS_ID], skip_special_tokens=True) == text


def test_shipped_warm_start_has_the_same_tokenizer() -> None:
    from transformers import AutoTokenizer

    from grpo_parts.train.lifecycle.setup import builtin_model_path

    tok = AutoTokenizer.from_pretrained(builtin_model_path(), local_files_only=True)
    hf = build_hf_tokenizer()
    assert tok.get_vocab() == hf.get_vocab()
    assert tok("99+1=").input_ids == hf("99+1=").input_ids


def test_asking_for_more_held_out_problems_than_exist_is_one_clear_error() -> None:
    """A small task has few distinct held-out problems: a larger num_eval must fail, not loop forever."""
    import pytest

    from grpo_parts.errors import GRPOPartsError
    from grpo_parts.task.reasoning import ReasoningConfig, ReasoningTask

    small = ArithmeticTask(ArithmeticConfig(operands=2, max_value=5, num_eval=50))
    with pytest.raises(GRPOPartsError, match=r"^task\.num_eval: got 50, .* expected <= \d+"):
        small.eval_problems()
    # the reasoning task's short problems (7 digits of 1-3) have ~220 held out; 600 cannot be served
    with pytest.raises(GRPOPartsError, match=r"^task\.num_eval: got 600, "):
        ReasoningTask(ReasoningConfig(num_eval=600)).eval_problems()
