"""Ctrl-C, SIGTERM and SIGKILL during `grpo-parts train`: what is saved, what status.json says, and
that resuming gives the metrics of an uninterrupted run (reference parts, built-in task)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from grpo_parts.cli import main
from grpo_parts.train.lifecycle.interrupt import Interrupted, StopRequest
from grpo_parts.train.lifecycle.status import read_status

#: 12 short steps of the built-in task (~0.2 s each on one thread), a checkpoint every 5
ARGS = ["train", "--reference", "--steps", "12", "--set", "prompts_per_step=4", "--set", "task.name=arithmetic",
        "--set", "task.num_eval=20",
        "--set", "eval_every=4", "--set", "checkpoint_every=5", "--set", "stop_after_flat=0",
        "--no-progress", "-q"]  # fmt: skip


def _rows(run: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without its timing fields."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timing = {"wall_time", "eval_time", "tokens_per_s"}
    return [{k: v for k, v in r.items() if k not in timing and not k.startswith("time_")} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("full")
    assert main([*ARGS, "--out-dir", str(out), "--name", "full"]) == 0
    return _rows(out / "full")


def _start_and_signal(tmp_path: Path, sig: int, after_steps: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_parts.cli", *ARGS, "--out-dir", str(tmp_path), "--name", "run"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 300
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 1 + after_steps:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_saves_the_last_step_and_resume_matches_an_uninterrupted_run(
    tmp_path: Path, sig: signal.Signals, uninterrupted: list[dict[str, Any]]
) -> None:
    proc, err = _start_and_signal(tmp_path, sig, after_steps=3)
    run = tmp_path / "run"
    assert proc.returncode == 128 + sig  # 130 / 143
    err = "\n".join(x for x in err.splitlines() if not x.startswith("WARNING step"))  # flat-reward steps
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    status = json.loads((run / "status.json").read_text())
    step = status["step"]
    assert 3 <= step < 12, "the run was not stopped mid-way"
    assert err.strip() == (
        f"grpo-parts train: interrupted by {sig.name} after step {step}; resume from step {step} with: "
        f"grpo-parts train --resume {run}"
    )
    assert status["status"] == "interrupted" and status["signal"] == sig.name and status["pid"] == proc.pid
    assert status["checkpoint"] == f"checkpoints/step-{step:06d}" and status["resume"].endswith(str(run))
    assert main(["train", "--resume", str(run), "--no-progress", "-q"]) == 0
    assert _rows(run) == uninterrupted
    assert json.loads((run / "status.json").read_text())["status"] == "completed"


def test_a_killed_run_is_a_stale_running_and_resumes_from_its_last_checkpoint(
    tmp_path: Path, uninterrupted: list[dict[str, Any]]
) -> None:
    proc, _ = _start_and_signal(tmp_path, signal.SIGKILL, after_steps=6)
    run = tmp_path / "run"
    status = read_status(run)
    assert status is not None and status["status"] == "running" and status["pid"] == proc.pid
    assert status["stale"] is True and status["checkpoint"] == "checkpoints/step-000005"
    assert main(["train", "--resume", str(run), "--no-progress", "-q"]) == 0
    assert _rows(run) == uninterrupted


def test_a_second_signal_mid_step_leaves_the_newest_checkpoint_to_resume(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_parts.task.arithmetic import ArithmeticTask
    from grpo_parts.train.config import load_config
    from grpo_parts.train.lifecycle.run import train
    from grpo_parts.train.step import loop

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, text, problem: float(len(text) % 3 == 0))
    cfg = load_config(overrides=tiny_overrides(tiny_model_dir, tmp_path, steps=4, checkpoint_every=2))
    cfg = cfg.with_reference_parts()
    full = train(cfg.model_copy(update={"name": "full"}))
    real_step = loop.GRPOTrainer.step

    def step(self: loop.GRPOTrainer) -> dict[str, Any]:
        if self.step_idx == 2:  # half-way through step 3, as a second Ctrl-C would
            real_step(self)
            raise Interrupted(signal.SIGINT)
        return real_step(self)

    monkeypatch.setattr(loop.GRPOTrainer, "step", step)
    with pytest.raises(Interrupted) as e:
        train(cfg.model_copy(update={"name": "cut"}))
    run = tmp_path / "cut"
    assert e.value.exit_code == 130
    assert str(e.value) == (
        f"grpo-parts train: interrupted by SIGINT during step 3; resume from step 2 with: "
        f"grpo-parts train --resume {run}"
    )
    assert json.loads((run / "status.json").read_text())["checkpoint"] == "checkpoints/step-000002"
    monkeypatch.setattr(loop.GRPOTrainer, "step", real_step)
    assert main(["train", "--resume", str(run), "--no-progress", "-q"]) == 0
    assert _rows(run) == _rows(full.run_dir)


def test_the_first_signal_asks_the_second_stops() -> None:
    notes: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as e, StopRequest(notes.append) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # delivered between bytecodes
        assert stop.signum == signal.SIGTERM and notes == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert e.value.exit_code == 130
    assert signal.getsignal(signal.SIGTERM) is before
