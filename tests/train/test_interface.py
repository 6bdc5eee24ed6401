"""The command's interface (issue 23 item 5): ``--version``, ``train --print-config`` (YAML that
``--config`` loads back to the same config), the headline line, and the calibrated thread count."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from grpo_parts import __version__
from grpo_parts.cli import main
from grpo_parts.train.cli import add_arguments, config_from_args, headline
from grpo_parts.train.config import load_config


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"grpo-parts {__version__}"
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.+)"$', pyproject, re.M).group(1) == __version__  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--reference", "--steps", "7", "--set", "loss.kl_coef=0.01", "--set", "task.name=arithmetic"],
        ["--filter", "keep_all", "--set", "parts.sampler_kwargs={max_draft_tokens: 4}", "--lr", "3e-5"],
    ],
    ids=["default", "reference-set", "parts"],
)
def test_print_config_round_trips_through_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    out = tmp_path / "runs"
    capsys.readouterr()
    assert main(["train", "--print-config", "--out-dir", str(out), *argv]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# grpo-parts train: the effective config")
    assert not out.exists()  # nothing is run or written
    f = tmp_path / "printed.yaml"
    f.write_text(text)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert load_config(f) == config_from_args(parser.parse_args(["--out-dir", str(out), *argv]))
    # and loading it with --config prints the same again
    assert main(["train", "--print-config", "--config", str(f)]) == 0
    assert capsys.readouterr().out == text


def test_print_config_of_a_resumed_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from grpo_parts.train.lifecycle.checkpoint import save_checkpoint

    cfg = load_config(overrides={"steps": 4, "task.name": "arithmetic", "lr": 3e-4})
    run = tmp_path / "r"
    save_checkpoint(
        run, {"step": 2, "policy": {"w": torch.ones(2)}}, cfg.model_dump(mode="json", exclude_unset=True)
    )
    capsys.readouterr()
    assert main(["train", "--print-config", "--resume", str(run), "--steps", "9"]) == 0
    f = tmp_path / "c.yaml"
    f.write_text(capsys.readouterr().out)
    assert load_config(f) == cfg.model_copy(update={"steps": 9})


def test_headline_names_the_mean_and_the_last_evaluation() -> None:
    s = {
        "initial_accuracy": 0.035,
        "final_accuracy": 0.845,
        "last_accuracy": 0.85,
        "steps": 15,
        "wall_time_s": 38.2,
    }
    assert headline({**s, "final_evals": 3}, Path("runs/x")) == (
        "held-out accuracy 0.035 -> 0.845 (mean of the last 3 evaluations; the last: 0.850) in 15 steps "
        "(38 s training); report: runs/x/report.md"
    )
    assert "0.845 (one evaluation) in 15 steps" in headline({**s, "final_evals": 1}, Path("runs/x"))


def test_thread_calibration_picks_a_candidate_and_leaves_no_trace(tiny_model_dir: Path) -> None:
    from grpo_parts.train.lifecycle.setup import load_model
    from grpo_parts.train.lifecycle.threads import calibrate_threads

    policy, _ = load_model(tiny_model_dir, torch.float32, torch.device("cpu"), progress=False)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    rng = torch.get_rng_state()
    old = torch.get_num_threads()
    try:
        threads, note = calibrate_threads(policy, rows=16, max_new_tokens=8, candidates=[1, 2])
        assert threads in (1, 2) and torch.get_num_threads() == threads
        assert note.startswith(f"threads: {threads} (calibrated: estimated step ") and "with" in note
    finally:
        torch.set_num_threads(old)
    assert torch.equal(torch.get_rng_state(), rng) and not policy.training
    assert all(p.grad is None for p in policy.parameters())
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_a_model_run_on_cpu_reports_its_calibrated_threads(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides
) -> None:
    from grpo_parts.train.lifecycle.run import train

    old = torch.get_num_threads()
    try:
        cfg = load_config(overrides=tiny_overrides(tiny_model_dir, tmp_path, threads=None, steps=1, name="t"))
        res = train(cfg.with_reference_parts())
    finally:
        torch.set_num_threads(old)
    assert "threads: " in (res.run_dir / "report.md").read_text()
