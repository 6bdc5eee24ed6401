"""A tiny random policy saved as a transformers folder, and a config small enough for seconds-long runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from grpo_parts.task.tokenizer import EOS_ID, PAD_ID, build_hf_tokenizer
    from grpo_parts.tiny import tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny_policy")
    tok = build_hf_tokenizer()
    model = tiny_causal_lm(
        "qwen2", vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64, eos_token_id=EOS_ID, pad_token_id=PAD_ID, seed=0,
    )  # fmt: skip
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _tiny_overrides(model_dir: Path, out_dir: Path, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": str(model_dir),
        "out_dir": str(out_dir),
        "steps": 3,
        "prompts_per_step": 3,
        "group_size": 4,
        "max_new_tokens": 6,
        "eval_every": 2,
        "task.name": "arithmetic",  # the short task: seconds-long runs
        "task.num_eval": 6,
        "threads": 1,
        "progress": False,
        "stop_after_flat": 0,  # a random policy's rewards are all 0: the flat-reward stop would end the run
    }
    base.update(extra)
    return base


@pytest.fixture
def tiny_overrides() -> Any:
    """``tiny_overrides(model_dir, out_dir, **extra) -> dict`` of dotted config overrides."""
    return _tiny_overrides


@pytest.fixture
def tiny_compare(tiny_model_dir: Path, tmp_path: Path) -> Any:
    """``tiny_compare(*flags) -> (rc, json)``: ``grpo-parts train --compare`` on the tiny policy and a
    30-problem JSONL, 2 steps, folder ``tmp_path/cmp``; ``flags`` are added (e.g. ``--seeds 2``)."""
    import json

    from grpo_parts.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(30))
    )
    out = tmp_path / "cmp.json"

    def run(*flags: str) -> tuple[int, Any]:
        rc = main(
            ["train", "--compare", *flags, "--model", str(tiny_model_dir), "--data", str(data), "--out-dir",
             str(tmp_path), "--name", "cmp", "--steps", "2", "--set", "prompts_per_step=2", "--set", "group_size=4",
             "--set", "max_new_tokens=4", "--set", "threads=1", "--no-progress", "-q", "--json", str(out)]
        )  # fmt: skip
        return rc, json.loads(out.read_text()) if out.is_file() else None

    return run


@pytest.fixture(scope="session")
def made_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A completed 3-step run with checkpoints at steps 2 and 3 (tests use copies, see ``old``)."""
    from cli_helpers import QUIET

    from grpo_parts.cli import main

    out = tmp_path_factory.mktemp("made")
    rc = main(["train", "--reference", "--model", str(tiny_model_dir), "--out-dir", str(out), "--name", "old",
               "--steps", "3", "--set", "prompts_per_step=2", "--set", "group_size=4", "--set", "max_new_tokens=4",
               "--set", "task.name=arithmetic", "--set", "task.num_eval=4", "--set", "threads=1",
               "--set", "checkpoint_every=2", "--set", "stop_after_flat=0", *QUIET])  # fmt: skip
    assert rc == 0
    return out / "old"


@pytest.fixture
def old(made_run: Path, tmp_path: Path) -> Path:
    """A fresh copy of the made run, under tmp_path/runs/old."""
    return Path(shutil.copytree(made_run, tmp_path / "runs" / "old"))
