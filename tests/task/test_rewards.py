"""--reward module:function[@weight]: TRL's reward-function signature, weights, None, one-line errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.task.arithmetic import ArithmeticTask
from grpo_parts.task.data import Problem
from grpo_parts.task.rewards import RewardedTask, load_rewards, parse_reward_spec

MODULE = """
seen = {}

def correct(completions, answer, **kwargs):
    seen.update(kwargs, completions=completions, answer=answer)
    return [1.0 if c.rsplit(";", 1)[-1] == a else 0.0 for c, a in zip(completions, answer)]

def short(completions, **kwargs):
    return [None if len(c) > 8 else 1.0 for c in completions]

def chat(prompts, completions, **kwargs):
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant") for p, c in zip(prompts, completions)]

def positional(completions):
    return [0.0 for _ in completions]

def wrong_length(completions, **kwargs):
    return [1.0]

def boom(completions, **kwargs):
    raise KeyError("answer")

broken = 3
"""


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "my_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import my_rewards  # type: ignore[import-not-found]

    return importlib.reload(my_rewards)


def test_spec_parsing() -> None:
    assert parse_reward_spec("m.sub:fn") == ("m.sub:fn", 1.0)
    assert parse_reward_spec("m:fn@0.5") == ("m:fn", 0.5)
    assert parse_reward_spec("dir/f.py:fn@-1") == ("dir/f.py:fn", -1.0)
    for bad in ("fn", "m:", ":fn", "m:fn@x", "m:f-n"):
        with pytest.raises(ValueError, match="expected 'module:function'"):
            parse_reward_spec(bad)


def test_weighted_sum_with_trl_arguments(module: Any) -> None:
    fns = load_rewards(["my_rewards:correct@2", "my_rewards:short@0.5"], ["answer"])
    task = RewardedTask(ArithmeticTask(), fns, steps=10)
    probs = [Problem("7+8=", "15"), Problem("1+1=", "2")]
    out = task.batch_rewards(["7+8=15;15", "3"], probs, [[1, 2], [3]], step=4)
    assert out == [2.0 + 0.0, 0.0 + 0.5]  # short() is None (not applicable) for the long completion
    seen = module.seen
    assert seen["answer"] == ["15", "2"] and seen["prompts"] == ["7+8=", "1+1="]
    assert seen["completion_ids"] == [[1, 2], [3]] and seen["trainer_state"].global_step == 4
    assert task.last_per_function == {"correct": 0.5, "short": 1.0}
    assert task.reward("7+8=15;15", probs[0]) == 1.0  # held-out accuracy keeps the task's grader


def test_chat_data_gets_messages(module: Any) -> None:
    (fn,) = load_rewards(["my_rewards:chat"], ["messages", "answer"])
    msgs = [{"role": "user", "content": "1+1="}]
    p = Problem("1+1=", "2", {"messages": msgs, "answer": "2"}, msgs)
    assert RewardedTask(ArithmeticTask(), [fn], 1).batch_rewards(["2"], [p], [[1]], 0) == [1.0]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
        ("my_rewards:missing", "has no function 'missing'"),
        ("my_rewards:broken", "has no function 'broken'"),
        ("my_rewards:positional", "cannot take TRL's reward arguments"),
        ("nowhere/f.py:fn", "no such file"),
    ],
)
def test_load_errors_are_one_line(module: Any, spec: str, needle: str) -> None:
    with pytest.raises(GRPOPartsError) as e:
        load_rewards([spec], ["answer"])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("name", "needle"), [("wrong_length", "expected a list of 2 floats"), ("boom", "raised KeyError")]
)
def test_call_errors_are_one_line(module: Any, name: str, needle: str) -> None:
    task = RewardedTask(ArithmeticTask(), load_rewards([f"my_rewards:{name}"], ["answer"]), 1)
    with pytest.raises(GRPOPartsError) as e:
        task.batch_rewards(["a", "b"], [Problem("1=", "1")] * 2, [[1], [1]], 0)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_file_path_module(tmp_path: Path) -> None:
    f = tmp_path / "r.py"
    f.write_text("def one(completions, **kw):\n    return [1] * len(completions)\n")
    task = RewardedTask(ArithmeticTask(), load_rewards([f"{f}:one@3"], ["answer"]), 1)
    out = task.batch_rewards(["x"], [Problem("1=", "1")], [[1]], 0)
    assert out == [3.0] and not math.isnan(out[0])
