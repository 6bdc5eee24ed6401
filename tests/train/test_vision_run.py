"""``grpo-parts train`` on the built-in vision task (#55): the shipped VLM warm start trains with
every part that takes images (the reference sampler rolls each image prompt out once per group, the
shared-prefix attention encodes each image once per group, CPPO prunes and refills), each counted;
the default sampler, which cannot take images, gives way to the reference with a note; a VLM
checkpoint of your own trains too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_parts.cli import main
from grpo_parts.compat import transformers_version
from grpo_parts.errors import GRPOPartsError
from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import train
from grpo_parts.train.lifecycle.setup import VISION_TASK_MIN, load_vlm
from grpo_parts.train.reporting.metrics import read_metrics

#: a short run: 4 prompts x 4 completions, CPPO pruning half with one refill round
SHORT = {"steps": 2, "prompts_per_step": 4, "group_size": 4, "eval_every": 2, "task.num_eval": 8,
         "stop_after_flat": 0, "progress": False, "parts.refill_rounds": 1,
         "parts.filter_kwargs": {"pruning_rate": 0.5}}  # fmt: skip


#: the built-in vision task's warm start and processor need transformers >= 5 (refused below it)
NEEDS_5 = pytest.mark.skipif(
    transformers_version() < VISION_TASK_MIN, reason="the vision task is refused below 5.0"
)


def _rows(tmp_path: Path, **over: Any) -> tuple[Path, list[dict[str, Any]]]:
    cfg = load_config(
        overrides={"out_dir": str(tmp_path), "name": "v", "task.name": "vision", **SHORT, **over}
    )
    run = train(cfg)
    return run.run_dir, [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "reward" in r]


@NEEDS_5
def test_the_vision_task_trains_with_every_part_that_takes_images(tmp_path: Path) -> None:
    run_dir, rows = _rows(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(rows) == 2
    for row in rows:
        assert row["attention_grids"] > 0  # the shared-prefix forward: each image once per group
        assert row["rounds"] == 2 and 0 < row["kept_fraction"] < 1  # CPPO pruned, one refill round
    assert "final_accuracy" in summary
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed"
    # the door's default sampler cannot take image prompts: the reference's, said in one note
    assert "sampler=reference" in str(summary) or "sampler=reference" in (run_dir / "report.md").read_text()
    # the exported model loads as transformers' VLM, and a next run takes it back with its processor
    from transformers import AutoModelForImageTextToText

    assert AutoModelForImageTextToText.from_pretrained(run_dir / "model").config.model_type == "qwen2_vl"
    model, processor = load_vlm(run_dir / "model", torch.float32, torch.device("cpu"), progress=False)
    assert hasattr(processor, "image_processor") and processor.tokenizer.padding_side == "left"


@NEEDS_5
def test_the_default_sampler_falls_back_and_a_set_one_is_refused() -> None:
    """The rule lives in build_parts: a default that cannot take images gives way to the reference
    (noted); the same sampler set by the user is refused with its reason."""
    from grpo_parts.errors import NotSupportedError
    from grpo_parts.parts_config import PartsConfig
    from grpo_parts.tiny_vision import tiny_vlm
    from grpo_parts.train.step.parts import build_parts

    model = tiny_vlm("qwen2_vl")
    cfg = PartsConfig.for_door("train")
    parts = build_parts(cfg, model, images=True)
    assert parts.names["sampler"] == "reference" and parts.draft is None
    assert any("does not take image prompts" in n for n in parts.notes)
    with pytest.raises(NotSupportedError, match="image prompts"):
        build_parts(cfg, model, images=True, defaults={"sampler": "reference"})


@NEEDS_5
def test_the_reference_arm_matches_the_optimized_arm_at_step_zero(tmp_path: Path) -> None:
    """The same first rollout (one seed) scored by the reference attention (each image repeated per
    completion) and by the shared prefix: the first step's loss and old log-probs agree."""
    _, opt = _rows(
        tmp_path / "a",
        steps=1,
        **{"parts.filter": "keep_all", "parts.filter_kwargs": {}, "parts.refill_rounds": 0},
    )
    _, ref = _rows(tmp_path / "b", steps=1, **{"parts.filter": "keep_all", "parts.filter_kwargs": {}, "parts.refill_rounds": 0,
                                              "parts.attention": "reference"})  # fmt: skip
    assert opt[0]["reward"] == ref[0]["reward"]
    assert opt[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-4, abs=1e-6)


def test_your_own_vlm_checkpoint_trains_on_the_vision_task(tmp_path: Path) -> None:
    """A LLaVA checkpoint with its processor files (AutoProcessor loads them) instead of the warm start."""
    from grpo_parts.tiny_vision import tiny_processor, tiny_vlm

    model = tiny_vlm("llava")
    model.save_pretrained(tmp_path / "vlm")
    tiny_processor(model).save_pretrained(tmp_path / "vlm")
    assert main(["train", "--model", str(tmp_path / "vlm"), "--set", "task.name=vision", "--steps", "1",
                 "--set", "prompts_per_step=2", "--set", "group_size=2", "--set", "task.num_eval=2",
                 "--set", "threads=1", "--out-dir", str(tmp_path), "--name", "own", "--no-progress", "-q"]) == 0  # fmt: skip
    # a random LLaVA earns no reward (nothing to score); it ran, on its own processor
    assert json.loads((tmp_path / "own" / "status.json").read_text())["status"] == "completed"
    assert [r for r in read_metrics(tmp_path / "own" / "metrics.jsonl") if "reward" in r]


ALTERNATE = """
def alternate(completions, image, **kwargs):
    assert all(x is not None for x in image)  # the data's image column reaches reward functions
    return [float(i % 2) for i in range(len(completions))]
"""


@NEEDS_5
def test_data_records_with_images_train_a_vlm(tmp_path: Path) -> None:
    """``--data`` in TRL's conversational image format (an ``image`` column of PNG paths) with a VLM
    checkpoint: the images reach the sampler and the shared-prefix attention, once per prompt."""
    from PIL import Image

    from grpo_parts.task.vision import draw_image, question_messages
    from grpo_parts.train.lifecycle.setup import builtin_model_path

    rows = []
    for i in range(12):
        cells = list(range(i % 4 + 1))
        Image.fromarray(draw_image(cells, [0] * len(cells), 16)).save(tmp_path / f"{i}.png")
        rows.append({"prompt": question_messages(), "image": f"{i}.png", "answer": str(len(cells))})
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "alternate.py").write_text(ALTERNATE)  # rewards that differ in every group
    assert main(["train", "--model", str(builtin_model_path("vision")), "--data", str(data), "--steps", "1",
                 "--set", "prompts_per_step=2", "--set", "group_size=2", "--set", "max_new_tokens=4",
                 "--reward", f"{tmp_path / 'alternate.py'}:alternate", "--set", "threads=1",
                 "--out-dir", str(tmp_path), "--name", "data", "--no-progress", "-q"]) == 0  # fmt: skip
    rows_out = [r for r in read_metrics(tmp_path / "data" / "metrics.jsonl") if "reward" in r]
    assert rows_out and rows_out[0]["attention_grids"] > 0


@pytest.mark.skipif(transformers_version() >= VISION_TASK_MIN, reason="the floor's refusal")
def test_the_vision_task_is_refused_in_one_line_below_its_transformers(tmp_path: Path) -> None:
    with pytest.raises(GRPOPartsError, match=r"^task.name: 'vision' needs transformers >= 5.0"):
        train(load_config(overrides={"out_dir": str(tmp_path), "name": "v", "task.name": "vision", **SHORT}))
    assert not (tmp_path / "v").exists()
