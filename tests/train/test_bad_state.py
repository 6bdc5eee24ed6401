"""Bad input and state (issue 23 item 6): malformed YAML in --config or a --set value, --resume of a
folder that is not a run, --resume from an earlier checkpoint of a run that went further (refused
unless --rewind, which moves the later state aside). Each refusal is one line, exit code 2, and the
run folder is byte for byte as it was. Also --compare's accuracy goal: "within 3 points or better"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import QUIET, refused, snapshot

from grpo_parts.cli import main
from grpo_parts.train.experiments.seeds import aggregate_seeds
from grpo_parts.train.reporting.metrics import accuracy_goal_met
from grpo_parts.train.reporting.report import write_compare


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("steps: 3\nloss: {kl_coef: 0.1\nlr: 1\n", "line 3, column 3: expected ',' or '}', but got ':'"),
        ("a: b: c\n", "line 1, column 5: mapping values are not allowed here"),
        ("steps: 3\n\tlr: 2\n", "line 2, column 1: found character '\\t' that cannot start any token"),
    ],
    ids=["unclosed-flow", "nested-colon", "tab"],
)
def test_malformed_yaml_config(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, old: Path, text: str, where: str
) -> None:
    cfg = old.parent / "run.yaml"
    cfg.write_text(text)
    before = snapshot(old.parent)
    argv = [
        "--config",
        str(cfg),
        "--model",
        str(tiny_model_dir),
        "--out-dir",
        str(old.parent),
        "--name",
        "new",
    ]
    refused(capsys, argv, f"config: {str(cfg)!r} is not valid YAML ({where}")
    assert snapshot(old.parent) == before
    cfg.write_bytes(b"\xff\xfe\x00")
    refused(capsys, argv, "is not valid YAML (not UTF-8 text)")


@pytest.mark.parametrize(
    "item", ["parts.filter_kwargs={pruning_rate: 0.5", "lr=[1", "loss={kl_coef: 0.1, :}"]
)
def test_malformed_yaml_set_value(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, old: Path, item: str
) -> None:
    before = snapshot(old.parent)
    argv = ["--set", item, "--model", str(tiny_model_dir), "--out-dir", str(old.parent), "--name", "new"]
    refused(capsys, argv, f"--set {item}: the value is not valid YAML (", "expected a YAML value")
    assert snapshot(old.parent) == before
    # a resumed run refuses --set anyway; the malformed value is still named first, in one line
    refused(capsys, ["--resume", str(old), "--set", item], "--set")
    assert snapshot(old.parent) == before


def test_resume_of_a_folder_that_is_not_a_run(capsys: pytest.CaptureFixture[str], old: Path) -> None:
    other = old.parent / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("a folder of something else\n")
    before = snapshot(old.parent)
    refused(
        capsys,
        ["--resume", str(other)],
        f"resume: {str(other)!r} is not a run folder (no checkpoints/, config.yaml, status.json, metrics.jsonl)",
    )
    # a --compare folder holds runs: the error names them
    refused(capsys, ["--resume", str(old.parent)], "is not a run folder", "it holds the runs old: resume one")
    assert snapshot(old.parent) == before


def test_resume_from_an_earlier_checkpoint_needs_rewind(
    capsys: pytest.CaptureFixture[str], old: Path
) -> None:
    before = snapshot(old)
    early = old / "checkpoints" / "step-000002"
    refused(
        capsys,
        ["--resume", str(early), "--steps", "4"],
        f"resume: {str(early)!r} is step 2 of a run that went on to 3",
        "pass --rewind to move it aside into",
        f"rewound-1', or resume the newest with --resume {old}",
    )
    refused(
        capsys, ["--resume", str(old), "--steps", "4", "--rewind"], "--rewind: ", "is the newest checkpoint"
    )
    refused(capsys, ["--rewind"], "--rewind: only used with --resume, got it without")
    assert snapshot(old) == before


def test_rewind_moves_the_later_state_aside(old: Path) -> None:
    before = snapshot(old)
    early = old / "checkpoints" / "step-000002"
    assert main(["train", "--resume", str(early), "--rewind", *QUIET]) == 0
    aside = old / "rewound-1"
    # the later checkpoint and model moved, every other file copied: all byte for byte as they were
    for rel, data in before.items():
        if rel.startswith(("checkpoints/step-000002", "checkpoints/last")):
            continue
        assert snapshot(aside).get(rel, "missing") == data, rel
    assert (aside / "checkpoints" / "last").read_text() == before["checkpoints/last"].decode()  # type: ignore[union-attr]
    rows = [json.loads(x) for x in (old / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert json.loads((old / "status.json").read_text())["status"] == "completed"
    assert (old / "model" / "config.json").is_file()
    # a second rewind goes to the next free folder; the first is never touched
    first = snapshot(aside)
    assert main(["train", "--resume", str(early), "--rewind", *QUIET]) == 0
    assert (old / "rewound-2" / "checkpoints" / "step-000003").is_dir() and snapshot(aside) == first


def _rows(final: float, step_s: float) -> list[dict]:
    rows: list[dict] = [{"step": 0, "wall_time": 0.0, "eval_accuracy": 0.1}]
    for s in range(1, 4):
        rows.append(
            {"step": s, "wall_time": s * step_s, "time_step": step_s, "reward": 0.5, "eval_accuracy": final}
        )
    return rows


@pytest.mark.parametrize(("opt", "met"), [(0.95, True), (0.81, True), (0.78, True), (0.76, False)])
def test_compare_more_accurate_optimized_meets_the_accuracy_goal(
    tmp_path: Path, opt: float, met: bool
) -> None:
    """Reference final accuracy 0.8; an optimized arm 15 points better meets "within 3 points or better"."""
    res = write_compare(tmp_path, {"reference": _rows(0.8, 4.0), "optimized": _rows(opt, 1.0)}, 0.6, {})
    assert res["speedup_to_target"] >= 3.0 and res["passes"] is met
    assert accuracy_goal_met(res["accuracy_diff"]) is met
    assert ("-> met" if met else "-> not met") in (tmp_path / "compare.md").read_text()
    assert "within 3 points or better" in (tmp_path / "compare.md").read_text()
    agg = aggregate_seeds([res, res], 0.6, [0, 1])
    assert agg["passes"] is met and agg["goals"]["mean_accuracy_diff_within_0.03"]["met"] is met
