"""End-to-end runs on a tiny random policy: run folder contents, resume, bad input, compare, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from grpo_parts.cli import main
from grpo_parts.errors import GRPOPartsError
from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import resume_config, train

COMPARED = ("reward", "accuracy", "kept", "prompts", "data_pos", "loss", "clip_fraction", "completion_len")


def test_run_writes_metrics_report_and_plots(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any
) -> None:
    import gc

    from grpo_parts.train.step.loop import GRPOTrainer

    cfg = load_config(overrides=tiny_overrides(tiny_model_dir, tmp_path, name="r"))
    frozen: list[int] = []
    step = GRPOTrainer.step

    def counting_step(self: GRPOTrainer) -> dict[str, Any]:
        frozen.append(gc.get_freeze_count())
        return step(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GRPOTrainer, "step", counting_step)
        res = train(cfg)
    # set-up's objects are out of the collector's view while the steps run, and back after
    assert frozen and min(frozen) > 0 and gc.get_freeze_count() == 0
    d = res.run_dir
    for f in (
        "metrics.jsonl",
        "report.md",
        "accuracy.png",
        "step_time.png",
        "acceptance.png",
        "config.yaml",
        "summary.json",
    ):
        assert (d / f).is_file(), f
    assert json.loads((d / "status.json").read_text())["status"] == "completed"
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval_accuracy"] is not None and rows[2]["eval_accuracy"] is not None
    for key in (
        "reward",
        "accuracy",
        "time_rollout",
        "time_training",
        "time_other",
        "tokens_per_s",
        "kept_fraction",
    ):
        assert key in rows[1], key
    assert "accepted_per_verify" in rows[1]


@pytest.mark.parametrize("parts", ["reference", "optimized"])
def test_resume_after_step_k_matches_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path, parts: str, tiny_overrides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_parts.task.arithmetic import ArithmeticTask

    # a dense reward, so that a random policy gets nonzero advantages and actually trains
    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, text, problem: float(len(text) % 3 == 0))
    extra = {"parts.sampler_kwargs": {"draft_tokens": 2}} if parts == "optimized" else {}
    base = load_config(overrides=tiny_overrides(tiny_model_dir, tmp_path, **extra))
    if parts == "reference":
        base = base.with_reference_parts()
    full = train(base.model_copy(update={"name": "full"}))
    part = train(base.model_copy(update={"name": "part", "steps": 2}))
    resumed = train(resume_config(part.run_dir, {"steps": 3}), run_dir=part.run_dir, resume=True)
    a = [r for r in full.rows if r["step"] == 3][0]
    b = [r for r in resumed.rows if r["step"] == 3][0]
    assert [r["step"] for r in resumed.rows] == [0, 1, 2, 3]
    assert a["kept"] > 0 and a["loss"] is not None  # the step did train
    for k in COMPARED:
        assert a.get(k) == pytest.approx(b.get(k), rel=1e-6, abs=1e-9), k


def test_missing_model_path_fails_before_creating_a_run_folder(tmp_path: Path, tiny_overrides: Any) -> None:
    cfg = load_config(overrides=tiny_overrides(tmp_path / "no_model", tmp_path / "runs", name="x"))
    with pytest.raises(GRPOPartsError, match="no such directory"):
        train(cfg)
    assert not (tmp_path / "runs" / "x").exists()


def test_a_vision_language_model_is_refused_in_one_line_before_a_run_folder(
    tmp_path: Path, tiny_overrides: Any
) -> None:
    """A VLM checkpoint on a text task gets one line naming what it is and where it trains (the
    vision task, tests/train/test_vision_run.py), never a loader's traceback."""
    from grpo_parts.tiny_vision import tiny_processor, tiny_vlm

    model = tiny_vlm("llava")
    model.save_pretrained(tmp_path / "vlm")
    tiny_processor(model).save_pretrained(tmp_path / "vlm")
    cfg = load_config(overrides=tiny_overrides(tmp_path / "vlm", tmp_path / "runs", name="x"))
    with pytest.raises(
        GRPOPartsError,
        match="is a vision-language model .llava.; grpo-parts train trains one on image prompts",
    ):
        train(cfg)
    assert not (tmp_path / "runs" / "x").exists()


def test_malformed_jsonl_fails_with_the_line_and_no_run_folder(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    rc = main(
        [
            "train",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--out-dir",
            str(tmp_path / "runs"),
            "--name",
            "y",
            "-q",
        ]
    )
    assert rc == 2
    assert not (tmp_path / "runs" / "y").exists()


def test_cli_out_of_range_value_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["train", "--steps", "0", "--out-dir", str(tmp_path), "-q"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "steps" in err and "greater than or equal to 1" in err
    assert not any(tmp_path.iterdir())


def test_a_run_that_crashes_is_marked_failed(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_overrides: Any
) -> None:
    from grpo_parts.train.step import loop

    def boom(self: object) -> None:
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(loop.GRPOTrainer, "step", boom)
    cfg = load_config(overrides=tiny_overrides(tiny_model_dir, tmp_path, name="c"))
    with pytest.raises(RuntimeError):
        train(cfg)
    status = json.loads((tmp_path / "c" / "status.json").read_text())
    assert status["status"] == "failed" and "simulated crash" in status["error"]
    assert not (tmp_path / "c" / "report.md").exists()


def test_jsonl_run_and_compare(tmp_path: Path, tiny_compare: Any) -> None:
    rc, res = tiny_compare()
    assert rc == 0
    for key in ("target_accuracy", "speedup_to_target", "final_accuracy_diff", "mean_step_speedup", "runs"):
        assert key in res
    assert set(res["runs"]) == {"reference", "optimized"}
    assert (tmp_path / "cmp" / "compare.png").is_file() and (tmp_path / "cmp" / "compare.md").is_file()


def test_help_lists_the_main_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--compare", "--model", "--data", "--resume", "--set", "--reference"):
        assert flag in out


def test_bench_e2e_is_the_compare_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "e2e", "--help"])
    assert "--json" in capsys.readouterr().out


def test_compare_over_seeds(tmp_path: Path, tiny_compare: Any) -> None:
    rc, res = tiny_compare("--seeds", "2", "--seed", "3")
    assert rc == 0
    assert res["seeds"] == [3, 4] and len(res["per_seed"]) == 2
    for key in ("median_speedup_to_target", "mean_step_speedup", "mean_final_accuracy_diff", "passes"):
        assert key in res
    # the contract of issue 17: per seed and as medians
    contract = (
        "speedup_to_target",
        "step_speedup",
        "accuracy_diff",
        "rollout_share",
        "amdahl_bound",
        "phases",
    )
    for r in (res, *res["per_seed"]):
        assert set(contract) <= set(r)
        assert set(r["phases"]) == {"rollout", "logprobs", "update", "draft", "other"}
        for p in r["phases"].values():
            assert set(p) == {"reference_s", "optimized_s", "ratio", "share"}
        assert r["amdahl_bound"] > 0 and 0 < r["rollout_share"] < 1
    for arm in ("reference", "optimized"):
        assert set(res["medians"][arm]) == {
            "time_to_target_s",
            "steps_to_target",
            "mean_step_s",
            "final_accuracy",
        }
    assert "Amdahl bound" in (tmp_path / "cmp" / "compare_seeds.md").read_text()
    assert (tmp_path / "cmp" / "seed3" / "compare.json").is_file()
    assert (tmp_path / "cmp" / "compare_seeds.md").is_file()


def test_reasoning_task_run_writes_the_decode_trace(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any
) -> None:
    """task.name=reasoning selects the long-instruction task; the speculative run reports, per decode step,
    the active rows, the chosen draft length and tokens per verification, and why speculation was off."""
    from grpo_parts.train.config import load_config
    from grpo_parts.train.lifecycle.run import train

    cfg = load_config(
        overrides=tiny_overrides(
            tiny_model_dir, tmp_path, name="r", steps=2, max_new_tokens=12, **{"task.name": "reasoning"}
        )
    )
    assert cfg.task.name == "reasoning"
    res = train(cfg)
    trace = json.loads((res.run_dir / "decode_trace.json").read_text())
    last = trace[max(trace, key=int)]
    assert len(last["active"]) == len(last["k"]) == len(last["tokens"]) > 0
    assert (res.run_dir / "decode_trace.png").is_file()
    report = (res.run_dir / "report.md").read_text()
    assert "per decode step" in report and "built-in reasoning" in report
    assert len(last["depth"]) == len(last["width"]) == len(last["k"])
    assert "| decode step | active rows | nodes per row | depth | width | tokens per verification |" in report
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("time_logprobs" in r and "time_update" in r for r in rows if r["step"] > 0)


def test_bench_e2e_preset_tiny_runs_every_arm_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPU end-to-end benchmark's code path, at a CPU test size: SFT, then each arm's GRPO steps."""
    out = tmp_path / "gpu.json"
    rc = main(["bench", "e2e", "--preset", "tiny", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["arms"]) == {"reference", "optimized"}
    for arm in res["arms"].values():
        assert arm["tokens_per_s_per_gpu"] > 0 and arm["step_s"] > 0
        assert set(arm["phase_shares"]) == {"rollout", "logprobs", "update", "draft", "other"}
    for key in ("model", "context_length", "group_size", "step_speedup"):
        assert key in res
    assert "tokens/s/GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [("constant", [1e-3, 1e-3, 1e-3, 1e-3]), ("linear", [1e-3, 7.5e-4, 5e-4, 2.5e-4]),
     ("cosine", [1e-3, 8.535533905932737e-4, 5e-4, 1.4644660940672627e-4])],
)  # fmt: skip
def test_lr_schedule_sets_each_steps_lr(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, schedule: str, expected: list[float]
) -> None:
    """The optimizer's lr follows the schedule from step_idx (decayed towards 0 at the last step)."""
    over = tiny_overrides(tiny_model_dir, tmp_path, name="s", steps=4, lr=1e-3, lr_schedule=schedule)
    # a filter that keeps every row, so every step has an update (and hence an lr)
    over["parts.filter"] = "keep_all"
    d = train(load_config(overrides=over)).run_dir
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r["step"] > 0] == pytest.approx(expected, rel=1e-12)


def test_setup_frozen_keeps_a_callers_own_freeze() -> None:
    """``train`` freezes set-up's objects only where nothing is frozen yet, and unfreezes only
    what it froze: a caller that froze its own objects finds them still frozen after."""
    import gc

    from grpo_parts.train.lifecycle.run import setup_frozen

    with setup_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    # The caller's own object, asked by identity: the frozen count alone can fall while frozen
    # objects die by reference count, so it cannot tell "unfrozen" from "freed".
    marker: list[object] = [object()]
    gc.freeze()
    try:
        with setup_frozen():
            assert not any(o is marker for o in gc.get_objects())
        assert not any(o is marker for o in gc.get_objects()), "the caller's freeze was undone"
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert any(o is marker for o in gc.get_objects())
