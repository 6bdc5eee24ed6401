"""--data formats (prompt/answer, messages, GSM8K, MATH; JSONL, parquet, save_to_disk), column mapping,
chat rendering, unencodable characters."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.task.data import Problem
from grpo_parts.task.formats import DATA_INSTALL, load_records
from grpo_parts.task.jsonl import DataConfig, JsonlTask, render
from grpo_parts.task.tokenizer import build_hf_tokenizer


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM8K = {"question": "1+2=", "answer": "1+2=3\n#### 3"}
MATH = {"problem": "1+2=", "solution": "so $\\boxed{\\frac{3}{1}}$"}
CHAT = {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3 #### 3"}]}


@pytest.mark.parametrize(
    ("row", "fmt", "answer"),
    [
        ({"prompt": "1+2=", "answer": 3}, "prompt_answer", "3"),
        (GSM8K, "gsm8k", "3"),
        (MATH, "math", "\\frac{3}{1}"),
        (CHAT, "messages", "3"),
        ({"messages": CHAT["messages"][:1], "answer": "3"}, "messages", "3"),
        ({"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}, "prompt_answer", "3"),
    ],
)
def test_formats_are_detected_and_give_the_final_answer(
    tmp_path: Path, row: dict[str, Any], fmt: str, answer: str
) -> None:
    records, got = load_records(_jsonl(tmp_path / "d.jsonl", [row]))
    assert got == fmt and records[0].answer == answer
    assert records[0].columns == row  # every column, for reward functions
    chat = isinstance(records[0].prompt, list)
    assert chat == ("messages" in row or isinstance(row.get("prompt"), list))
    if chat:
        assert records[0].prompt[-1]["role"] == "user"  # the assistant's gold message is not in the prompt


def test_column_names_can_be_mapped(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "d.jsonl", [{"query": "1+2=", "label": "x #### 3"}])
    records, fmt = load_records(f, "gsm8k", prompt_key="query", answer_key="label")
    assert (fmt, records[0].prompt, records[0].answer) == ("gsm8k", "1+2=", "3")
    with pytest.raises(GRPOPartsError, match=r"d.jsonl:1: missing key\(s\) \['label'\]"):
        load_records(_jsonl(tmp_path / "d.jsonl", [{"query": "q"}]), prompt_key="query", answer_key="label")


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"question": "q", "answer": "42"}, "no final answer after '####'"),
        ({"problem": "q", "solution": "42"}, "no \\boxed{...} final answer"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no final assistant message"),
        ({"messages": [{"role": "user"}]}, "must be a non-empty list of"),
        ({"text": "q"}, "expected prompt/answer, messages"),
    ],
)
def test_bad_records_name_the_line(tmp_path: Path, row: dict[str, Any], needle: str) -> None:
    with pytest.raises(GRPOPartsError) as e:
        load_records(_jsonl(tmp_path / "d.jsonl", [row]))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_parquet_and_save_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([GSM8K, {"question": "2+2=", "answer": "#### 4"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    for path in ("d.parquet", "folder", "dict"):
        records, fmt = load_records(tmp_path / path)
        assert fmt == "gsm8k" and [r.answer for r in records] == ["3", "4"], path
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(GRPOPartsError, match=r"holds the splits \['test'\]; expected a 'train' split"):
        load_records(tmp_path / "nosplit")
    (tmp_path / "plain").mkdir()
    with pytest.raises(GRPOPartsError, match="not a datasets save_to_disk folder"):
        load_records(tmp_path / "plain")


@pytest.mark.parametrize(("module", "suffix"), [("pyarrow.parquet", "d.parquet"), ("datasets", "folder")])
def test_missing_data_packages_name_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, suffix: str
) -> None:
    path = tmp_path / suffix
    if suffix == "folder":
        path.mkdir()
        (path / "dataset_info.json").write_text("{}")
    else:
        path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(GRPOPartsError) as e:
        load_records(path)
    assert DATA_INSTALL in str(e.value)
    assert DATA_INSTALL == "pip install -e '.[data]' in a checkout, or pip install 'grpo-parts[data]'"


def test_chat_needs_a_template_and_renders_with_it(tmp_path: Path) -> None:
    tok = build_hf_tokenizer()
    records, _ = load_records(_jsonl(tmp_path / "d.jsonl", [CHAT]))
    with pytest.raises(GRPOPartsError, match="has no chat template"):
        render(records, tok, "m")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (p,) = render(records, tok, "m")
    assert (p.prompt, p.answer, p.messages) == ("1+2=", "3", CHAT["messages"][:1])


def test_unknown_characters_are_refused_or_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = build_hf_tokenizer()  # digits and + - * = , ; : and space only
    rows = [{"prompt": "What is 1+2?", "answer": "3"}] * 3 + [{"prompt": "1+1=", "answer": "Two"}]
    f = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(GRPOPartsError) as e:
        JsonlTask.from_files(f, eval_fraction=0.25, tokenizer=tok)
    msg = str(e.value)
    assert "\n" not in msg and "21 characters of the prompts and 3 of the answers" in msg
    assert "'W' x3" in msg and "'<unk>'" in msg and "task.unknown_chars=warn" in msg
    task = JsonlTask.from_files(f, eval_fraction=0.25, tokenizer=tok, config=DataConfig(unknown_chars="warn"))
    assert any("21 characters of the prompts" in n for n in task.notes)
    assert caplog.text.count("not in the tokenizer's vocabulary") == 1


def test_builtin_task_data_grades_like_the_task(tmp_path: Path) -> None:
    from grpo_parts.task.reasoning import ReasoningTask

    rt = ReasoningTask()
    probs = [rt.train_problem(i) for i in range(20)]
    rows = [
        {"question": p.prompt, "answer": f"{rt.sft_target(p).rsplit(';', 1)[0]}\n#### {p.answer}"}
        for p in probs
    ]
    task = JsonlTask.from_files(_jsonl(tmp_path / "g.jsonl", rows), eval_fraction=0.1)
    assert task.grader_name == "after_delimiter ';'" and "built-in reasoning task" in task.notes[0]
    p = task.train[0]
    good = rt.sft_target(p)
    assert task.reward(good, p) == rt.reward(good, p) == 1.0  # ...=15;15 against 15
    bad = good.rsplit(";", 1)[0] + ";1"
    assert task.reward(bad, p) == rt.reward(bad, p) == 0.0
    # the case: prompt/answer JSONL of the arithmetic task's own problems
    sums = _jsonl(
        tmp_path / "s.jsonl", [{"prompt": "7+8=", "answer": "15"}, {"prompt": "1+2+3=", "answer": "6"}]
    )
    t2 = JsonlTask.from_files(sums, eval_fraction=0.5)
    assert t2.reward("7+8=15;15", Problem("7+8=", "15")) == 1.0
