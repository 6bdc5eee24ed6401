"""docs/training.md documents every config field and every file of a run folder (issue 23 item 5);
the GRPO maths configs are documented field by field in docs/core_maths.md."""

from __future__ import annotations

import importlib.util
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from grpo_parts.core import AdvantageConfig, CorrectionConfig, LossConfig
from grpo_parts.train.config import PartsConfig, TrainConfig, load_config
from grpo_parts.train.lifecycle.run import train

DOCS = Path(__file__).parents[2] / "docs"
TRAINING = (DOCS / "training.md").read_text()


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end > 0 else None]


def test_every_train_config_field_is_documented() -> None:
    fields = _section(TRAINING, "### Every field")
    named = set(re.findall(r"`([a-z_]+)(?:\.\*)?`", fields))
    assert set(TrainConfig.model_fields) <= named, set(TrainConfig.model_fields) - named
    assert set(PartsConfig.model_fields) <= set(re.findall(r"`(?:parts\.)?([a-z_]+)`", TRAINING))
    for task in typing.get_args(TrainConfig.model_fields["task"].annotation):
        missing = {f for f in task.model_fields if f"`{f}`" not in fields}
        assert not missing, (task.__name__, missing)


@pytest.mark.parametrize("model", [LossConfig, AdvantageConfig, CorrectionConfig])
def test_every_maths_field_is_documented(model: Any) -> None:
    maths = (DOCS / "core_maths.md").read_text()
    missing = {f for f in model.model_fields if f"`{f}`" not in maths}
    assert not missing, (model.__name__, missing)


def test_every_run_folder_file_is_documented(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any
) -> None:
    trackers = ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    over = tiny_overrides(tiny_model_dir, tmp_path, name="r", steps=1, report_to=trackers)
    run = train(load_config(overrides={**over, "parts.sampler_kwargs": {"draft_tokens": 2}})).run_dir
    folder = _section(TRAINING, "## The run folder")
    entries = {p.name + ("/" if p.is_dir() else "") for p in run.iterdir()}
    assert {"decode_trace.json", "samples.jsonl", "model/", "checkpoints/"} <= entries
    missing = {e for e in entries if f"`{e}`" not in folder}
    assert not missing, missing
