"""TrainConfig: YAML + dotted overrides, clear range errors, part names with default fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.train.config import REFERENCE_PARTS, PartsConfig, TrainConfig, load_config, parse_override
from grpo_parts.train.step.parts import resolve_name


def test_defaults_are_valid_and_optimized() -> None:
    cfg = load_config()
    assert cfg.parts.sampler != "reference" and cfg.parts.filter != "keep_all"
    ref = cfg.with_reference_parts()
    assert {k: getattr(ref.parts, k) for k in REFERENCE_PARTS} == REFERENCE_PARTS


def test_yaml_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("steps: 7\nloss:\n  eps_high: 0.28\nparts:\n  filter: keep_all\n")
    cfg = load_config(f, {"seed": 3}, ["loss.kl_coef=0.01", "parts.filter_kwargs={}", "lr=1e-4"])
    assert (cfg.steps, cfg.seed, cfg.lr) == (7, 3, 1e-4)
    assert (cfg.loss.eps_high, cfg.loss.kl_coef, cfg.parts.filter) == (0.28, 0.01, "keep_all")


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (["steps=0"], "steps"),
        (["group_size=1"], "group_size"),
        (["lr=-1"], "lr"),
        (["loss.eps_low=1.5"], "loss.eps_low"),
        (["top_p=0"], "top_p"),
        (["bogus=1"], "bogus"),
        (["minibatches=99"], "minibatches"),
    ],
)
def test_out_of_range_values_name_the_field(sets: list[str], field: str) -> None:
    with pytest.raises(GRPOPartsError) as e:
        load_config(sets=sets)
    assert field in str(e.value)


def test_bad_override_syntax_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GRPOPartsError, match="KEY=VALUE"):
        parse_override("steps")
    with pytest.raises(GRPOPartsError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


def test_default_part_falls_back_with_a_note_but_explicit_unknown_name_fails() -> None:
    notes: list[str] = []
    cfg = PartsConfig(sampler="not_landed_yet")  # an unavailable *default* of this door
    assert resolve_name("sampler", cfg, notes, defaults={"sampler": "not_landed_yet"}) == "reference"
    assert notes and "not_landed_yet" in notes[0]
    with pytest.raises(GRPOPartsError, match="unknown implementation"):
        resolve_name("filter", PartsConfig(filter="nope"), [])


def test_config_is_frozen() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        TrainConfig().steps = 3  # type: ignore[misc]


def test_data_task_section_and_rewards() -> None:
    from grpo_parts.task.jsonl import DataConfig

    cfg = load_config(overrides={"data": "d.jsonl", "task.grader": "boxed", "task.prompt_key": "q"})
    assert isinstance(cfg.task, DataConfig) and (cfg.task.grader, cfg.task.prompt_key) == ("boxed", "q")
    assert (cfg.steps, cfg.max_new_tokens, cfg.stop_after_flat) == (15, 320, 3)  # --data's defaults as before
    assert load_config(overrides={"data": "d.jsonl", "rewards": ["m:f@0.5", "m:g"]}).rewards == [
        "m:f@0.5",
        "m:g",
    ]
    with pytest.raises(GRPOPartsError, match="task.name: 'data' reads --data, got no data"):
        load_config(overrides={"task.name": "data"})
    with pytest.raises(GRPOPartsError, match="task.data.grader: Input should be"):
        load_config(overrides={"data": "d.jsonl", "task.grader": "fuzzy"})
    with pytest.raises(GRPOPartsError, match="rewards: got 'm.f'; expected 'module:function'"):
        load_config(overrides={"rewards": ["m.f"]})


def test_config_errors_one_line_each() -> None:
    """One problem: one line, our validator's message not repeated; several: one line per field."""
    with pytest.raises(GRPOPartsError) as e:
        load_config(overrides={"rewards": ["m.f"]})
    assert (
        str(e.value).count("\n") == 0 and str(e.value).count("m.f") == 1 and "Value error" not in str(e.value)
    )
    with pytest.raises(GRPOPartsError) as e:
        load_config(sets=["seed=x", "group_size=y"])
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid training config:" and len(lines) == 3
    assert lines[1].strip().startswith("seed: ") and lines[1].endswith("got 'x'")
    assert lines[2].strip().startswith("group_size: ") and lines[2].endswith("got 'y'")
