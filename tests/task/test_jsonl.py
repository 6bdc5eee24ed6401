"""Real-use data: JSONL loading with line-level errors, the held-out split, the answer checker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.task.formats import load_records
from grpo_parts.task.jsonl import (
    MATH_INSTALL,
    DataConfig,
    JsonlTask,
    choose_grader,
    exact_match,
    final_answer,
)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_loads_records_and_skips_blank_lines(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "d.jsonl",
        [json.dumps({"prompt": "1+1=", "answer": 2}), "", json.dumps({"prompt": "x", "answer": "y"})],
    )
    probs, _ = load_records(f, "prompt_answer")
    assert [(p.prompt, p.answer) for p in probs] == [("1+1=", "2"), ("x", "y")]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"prompt": "a", "answer": ', "not valid JSON"),  # truncated JSON
        ('["a", "b"]', "expected a JSON object"),
        ('{"prompt": "a"}', "missing key(s) ['answer']"),
        ('{"prompt": "", "answer": "1"}', "'prompt' must be a non-empty string"),
        ('{"prompt": "a", "answer": [1]}', "'answer' must be a string or a number"),
    ],
)
def test_malformed_line_names_the_line_and_the_problem(tmp_path: Path, line: str, needle: str) -> None:
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "ok", "answer": "1"}), line])
    with pytest.raises(GRPOPartsError) as e:
        load_records(f, "prompt_answer")
    assert f"{f}:2" in str(e.value)
    assert needle in str(e.value)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(GRPOPartsError, match="no such file"):
        load_records(tmp_path / "nope.jsonl", "prompt_answer")
    with pytest.raises(GRPOPartsError, match="no records"):
        load_records(_write(tmp_path / "e.jsonl", [""]), "prompt_answer")


def test_final_answer_and_exact_match() -> None:
    assert final_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert final_answer("work #### 42 ") == "42"
    assert exact_match(" 7 ", "7") and not exact_match("71", "7")


def test_split_is_deterministic_disjoint_and_epochs_cover_the_train_set(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(40)])
    a = JsonlTask.from_files(f, eval_fraction=0.1, seed=1)
    b = JsonlTask.from_files(f, eval_fraction=0.1, seed=1)
    assert a.eval_problems() == b.eval_problems() and len(a.eval_problems()) == 4
    assert not {p.prompt for p in a.eval_problems()} & {p.prompt for p in a.train}
    epoch0 = [a.train_problem(i).prompt for i in range(36)]
    assert sorted(epoch0) == sorted(p.prompt for p in a.train)
    assert [a.train_problem(i).prompt for i in range(36, 72)] != epoch0  # reshuffled per epoch
    assert a.reward("#### 5", a.train[0]) in (0.0, 1.0)


def test_missing_math_verify_hint_installs_the_extra_from_the_checkout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails as if not installed
    grader, _, why = choose_grader(DataConfig(), "prompt_answer", None)
    assert grader == "exact"
    # both spellings: the command that works from a checkout and the package name
    assert MATH_INSTALL == "pip install -e '.[math]' in a checkout, or pip install 'grpo-parts[math]'"
    assert MATH_INSTALL in why
    docs = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    assert "pip install -e '.[math]'" in docs and "pip install 'grpo-parts[math]'" in docs
