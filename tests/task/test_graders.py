"""Named graders (task.grader) and the default chosen from the data."""

from __future__ import annotations

import sys

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.task.graders import MATH_INSTALL, make_grader
from grpo_parts.task.jsonl import DataConfig, builtin_task_of, choose_grader


@pytest.mark.parametrize(
    ("grader", "delimiter", "completion", "answer", "expected"),
    [
        ("exact", ";", " 15 ", "15", True),
        ("exact", ";", "so \\boxed{15}", "15", True),
        ("exact", ";", "work #### 15", "15", True),
        ("exact", ";", "7+8=15;15", "15", False),  # the whole completion is its final answer
        ("after_delimiter", ";", "7+8=15;15", "15", True),  # the case
        ("after_delimiter", ";", "7+8=15;8", "15", False),
        ("after_delimiter", ";", "15", "15", False),  # no delimiter: wrong, as the built-in tasks grade
        ("after_delimiter", "####", "so #### 42", "42", True),
        ("after_delimiter", "answer:", "x answer: 42", "42", True),
        ("boxed", ";", "a \\boxed{\\frac{1}{2}} b", "\\frac{1}{2}", True),
        ("boxed", ";", "1/2", "1/2", False),
        ("last_number", ";", "7+8=15;15", "15", True),
        ("last_number", ";", "total 1,000.0 dollars", "1000", True),
        ("last_number", ";", "it is 2.50", "2.5", True),
        ("last_number", ";", "-3 then 4", "-3", False),
        ("last_number", ";", "none", "3", False),
    ],
)
def test_graders(grader: str, delimiter: str, completion: str, answer: str, expected: bool) -> None:
    assert make_grader(grader, delimiter)(completion, answer) is expected


def test_default_grader_follows_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as without the [math] extra
    cfg = DataConfig()
    assert choose_grader(cfg, "gsm8k", None)[:2] == ("after_delimiter", "####")
    assert choose_grader(cfg, "math", None)[0] == "boxed"
    assert choose_grader(cfg, "prompt_answer", None)[0] == "exact"
    assert choose_grader(cfg, "gsm8k", "reasoning")[:2] == ("after_delimiter", ";")
    assert choose_grader(DataConfig(grader="last_number"), "gsm8k", "reasoning")[0] == "last_number"
    assert (
        choose_grader(DataConfig(grader="after_delimiter", delimiter="answer:"), "math", None)[1] == "answer:"
    )
    with pytest.raises(GRPOPartsError) as e:
        make_grader("math_verify")
    assert MATH_INSTALL in str(e.value) and "\n" not in str(e.value)


def test_builtin_task_prompts_are_recognised() -> None:
    from grpo_parts.task.reasoning import ReasoningTask

    assert builtin_task_of([ReasoningTask().train_problem(i).prompt for i in range(5)]) == "reasoning"
    assert builtin_task_of(["17+25+9=", "1+2="]) == "arithmetic"
    assert builtin_task_of(["17+25+9=", "what is 1+2?"]) is None
