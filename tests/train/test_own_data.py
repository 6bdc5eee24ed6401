"""Issue 23's acceptance: the shipped warm start trained with ``--model --data`` on the built-in reasoning
task's problems written as a user's data -- GSM8K-style JSONL, chat ``messages``, and prompt/answer with
a ``--reward module:function`` -- learns as the built-in run does, and ``samples.jsonl`` holds
completions with rewards. With these sizes (short problems only, 50 held-out, 2 steps, draft length 4)
the built-in task goes 0.04 -> 0.56 held-out accuracy, and each of these runs 0.04 -> 0.60 (measured on
the project's 2-core machine); each run takes ~25 s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from grpo_parts.cli import main
from grpo_parts.task.reasoning import INSTRUCTION, ReasoningConfig, ReasoningTask
from grpo_parts.train.lifecycle.setup import builtin_model_path

TASK = ReasoningTask(ReasoningConfig(long_every=1000, num_eval=50))  # short problems only
TRAIN = [TASK.train_problem(i) for i in range(200)]
EVAL = TASK.eval_problems()
RUN = ["--steps", "2", "--set", "eval_every=2", "--set", "max_new_tokens=80", "--set", "threads=1",
       "--set", "parts.sampler_kwargs={draft_tokens: 4}",  # no timing-based calibration: the same run every time
       "--no-progress", "-q"]  # fmt: skip


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gsm8k(p: Any) -> dict[str, str]:
    worked = TASK.sft_target(p).rsplit(";", 1)[0]
    return {"question": p.prompt, "answer": f"{worked}\n#### {p.answer}"}


def chat(p: Any) -> dict[str, Any]:
    system, user = p.prompt[: len(INSTRUCTION)], p.prompt[len(INSTRUCTION) :]
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"messages": msgs, "answer": p.answer}


def _train(
    tmp_path: Path, name: str, model: Path, rows: Any, *flags: str
) -> tuple[list[dict[str, Any]], Path]:
    data = _write(tmp_path / f"{name}.jsonl", [rows(p) for p in TRAIN])
    evals = _write(tmp_path / f"{name}_eval.jsonl", [rows(p) for p in EVAL])
    argv = ["train", "--model", str(model), "--data", str(data), "--eval-data", str(evals),
            "--out-dir", str(tmp_path), "--name", name, *RUN, *flags]  # fmt: skip
    assert main(argv) == 0
    run = tmp_path / name
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], run


#: held-out accuracy curve of each run of this module: the three formats hold the same problems in the
#: same order, render to the same prompts and grade (or reward) alike, so their runs are identical
CURVES: dict[str, list[float]] = {}


def _rises(name: str, rows: list[dict[str, Any]]) -> None:
    accs = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
    assert accs[0] < 0.2, accs  # the warm start's habit: the first partial sum as the answer
    assert accs[-1] >= accs[0] + 0.3, accs  # GRPO removes it, as on the built-in task (0.04 -> 0.60 here)
    for other, curve in CURVES.items():
        assert accs == curve, (name, other)
    CURVES[name] = accs


def _samples(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"eval", "train"} and {r["step"] for r in rows} == {0, 2}
    for r in rows:
        assert set(r) >= {"prompt", "answer", "completion", "reward"} and isinstance(r["reward"], float)
    assert any(r["reward"] > 0 for r in rows if r["step"] == 2)
    assert "Held-out completions at step 2" in (run / "report.md").read_text()
    return rows


def test_gsm8k_data_of_the_builtin_task_learns_as_the_task(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="grpo_parts.train"):
        rows, run = _train(tmp_path, "gsm8k", builtin_model_path("reasoning"), gsm8k)
    assert "grader: after_delimiter ';' (the prompts are the built-in reasoning task's" in caplog.text
    _rises("gsm8k", rows)
    _samples(run)


def test_messages_data_is_rendered_with_the_chat_template(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    model = tmp_path / "model"
    shutil.copytree(builtin_model_path("reasoning"), model)
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(model)
    rows, run = _train(tmp_path, "chat", model, chat)
    _rises("messages", rows)
    assert _samples(run)[0]["prompt"] == EVAL[0].prompt  # system + user, rendered by the template


REWARD = """
def after_semicolon(completions, answer, **kwargs):
    return [1.0 if ";" in c and c.rsplit(";", 1)[1].strip() == a else 0.0 for c, a in zip(completions, answer)]
"""


def test_reward_function_run(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(REWARD)
    spec = f"{tmp_path / 'my_reward.py'}:after_semicolon@1.0"
    plain = lambda p: {"prompt": p.prompt, "answer": p.answer}  # noqa: E731
    rows, run = _train(tmp_path, "fn", builtin_model_path("reasoning"), plain, "--reward", spec)
    _rises("reward", rows)
    assert all("reward_after_semicolon" in r for r in rows if r["step"] > 0)
    _samples(run)
