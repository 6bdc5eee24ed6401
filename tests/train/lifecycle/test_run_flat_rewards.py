"""A run whose rewards are all equal warns each step and stops after stop_after_flat of them (one line,
exit 2, a checkpoint and a resume hint); a bad --reward fails before the run folder exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_parts.cli import main

SMALL = ["--set", "prompts_per_step=2", "--set", "group_size=4", "--set", "max_new_tokens=4", "--set", "threads=1",
         "--set", "eval_every=1", "--no-progress", "-q"]  # fmt: skip


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "9999"}) + "\n" for i in range(20)))
    return path


def test_flat_rewards_warn_then_stop_with_a_resume_hint(
    tiny_model_dir: Path,
    tmp_path: Path,
    data: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a random policy never writes 9999: every reward is 0
    argv = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out-dir", str(tmp_path), "--name", "r",
            "--steps", "6", "--set", "stop_after_flat=2", "--set", "task.grader=exact", *SMALL]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    warnings = [r.getMessage() for r in caplog.records if "every reward is" in r.getMessage()]
    assert len(warnings) == 2 and all(
        r.levelname == "WARNING" for r in caplog.records if "every reward" in r.getMessage()
    )
    assert "every reward is 0 (grader: exact)" in warnings[0] and "for answer '9999'" in warnings[0]
    (line,) = err.strip().splitlines()
    run = tmp_path / "r"
    assert line.startswith("grpo-parts train: error: rewards: every reward of steps 1-2 is 0 (grader: exact)")
    assert line.endswith(f"resume with: grpo-parts train --resume {run}")
    status = json.loads((run / "status.json").read_text())
    assert (
        status["status"] == "failed"
        and status["step"] == 2
        and status["checkpoint"] == "checkpoints/step-000002"
    )
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert {(s["step"], s["split"]) for s in samples} == {
        (0, "eval"),
        (1, "eval"),
        (1, "train"),
        (2, "eval"),
        (2, "train"),
    }
    assert all(s["reward"] == 0.0 and s["answer"] == "9999" for s in samples)
    # the resumed run keeps the samples up to its checkpoint and counts flat steps anew
    assert main(["train", "--resume", str(run), "--no-progress", "-q"]) == 2
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert max(s["step"] for s in samples) == 4
    assert len(samples) == 1 + 4 * (1 + 4)  # 1 held-out problem per evaluation, 4 training rows per step


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nope_module_xyz:fn", "reward: cannot import 'nope_module_xyz'"),
        ("bad spec", "invalid training config: rewards: got 'bad spec'; expected 'module:function'"),
        ("{f}:positional", "cannot take TRL's reward arguments"),
    ],
)
def test_bad_reward_is_one_line_before_the_run_folder(
    tiny_model_dir: Path,
    tmp_path: Path,
    data: Path,
    capsys: pytest.CaptureFixture[str],
    spec: str,
    needle: str,
) -> None:
    f = tmp_path / "r.py"
    f.write_text("def positional(completions):\n    return [0.0] * len(completions)\n")
    argv = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out-dir", str(tmp_path / "runs"),
            "--name", "r", "--reward", spec.format(f=f), *SMALL]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()
