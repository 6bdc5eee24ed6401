"""Checkpoint format (safetensors + weights_only state), atomic writes, the kept pair, every draft's
state under weights_only, and the exported model folder."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_parts.build import construct as _construct
from grpo_parts.cli import main
from grpo_parts.draft import get_draft_class
from grpo_parts.draft.protocol import DraftTrainingBatch
from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle import checkpoint as ck
from grpo_parts.train.lifecycle.run import train


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture
def dense_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward a random policy often earns, so that a step actually changes the weights."""
    from grpo_parts.task.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, text, problem: float(len(text) % 3 == 0))


def test_checkpoint_folders_weights_only_and_the_kept_pair(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(
        overrides=tiny_overrides(tiny_model_dir, tmp_path, name="r", steps=5, checkpoint_every=2)
    )
    run = train(cfg.with_reference_parts()).run_dir / "checkpoints"
    assert sorted(p.name for p in run.iterdir()) == ["last", "step-000004", "step-000005"]
    assert (run / "last").read_text().strip() == "step-000005"
    folder = run / "step-000005"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.json", "policy.safetensors", "state.pt"]
    calls: list[Any] = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k.get("weights_only")) or real(*a, **k))
    _, got = ck.load_checkpoint(run.parent)
    assert calls == [True] and got.step == 5 and got.state is not None
    assert set(got.state) >= {"policy", "optimizer", "rng", "step", "data_pos"}
    # resuming from the older one (--rewind) moves the newer aside: the new pair is (resumed-from, new)
    argv = ["train", "--resume", str(run / "step-000004"), "--steps", "6", "--no-progress", "-q"]
    assert main([*argv, "--rewind"]) == 0
    assert sorted(p.name for p in run.iterdir()) == ["last", "step-000004", "step-000006"]
    assert (run.parent / "rewound-1" / "checkpoints" / "step-000005" / "state.pt").is_file()
    rows = [json.loads(x) for x in (run.parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))


def test_a_failed_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"step": 1, "policy": {"w": torch.ones(3)}, "rng": {"python": (3, (1, 2), None)}}
    ck.save_checkpoint(tmp_path, state, {"steps": 2})

    def broken(*a: Any, **k: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, {**state, "step": 2}, {"steps": 2}, previous=1)
    monkeypatch.undo()
    _, got = ck.load_checkpoint(tmp_path)
    assert got.step == 1 and _equal(got.state, state)
    ck.save_checkpoint(tmp_path, {**state, "step": 2}, {"steps": 2}, previous=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "last",
        "step-000001",
        "step-000002",
    ]


def test_shared_tensors_are_stored_once_and_come_back_shared(tmp_path: Path) -> None:
    w = torch.randn(4, 3)
    tensors = {"embed": w, "lm_head": w, "tail": w[1:], "other": torch.zeros(2)}
    ck._save_weights(tmp_path / "w.safetensors", tensors)
    got = ck._load_weights(tmp_path / "w.safetensors")
    assert _equal(got, tensors)
    assert got["lm_head"] is got["embed"]


def _train_batch(policy: torch.nn.Module) -> DraftTrainingBatch:
    ids = torch.randint(1, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    out = policy(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    mask = torch.zeros_like(ids)
    mask[:, 5:-1] = 1
    return DraftTrainingBatch(ids, mask, out.hidden_states[-1].detach(), out.logits.detach(), attn)


@pytest.mark.parametrize("name", ["ngram", "eagle", "small_lm", "frozen_lm"])
def test_every_draft_state_round_trips_under_weights_only(name: str, tmp_path: Path) -> None:
    from grpo_parts.tiny import tiny_causal_lm

    policy = tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=2, seed=0)
    cls = get_draft_class(name)
    draft = _construct(cls, policy, {}, {})
    draft.observe(torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.long), torch.tensor([0]))
    draft.update(_train_batch(policy))
    state = draft.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    assert _equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), state)
    # and through a checkpoint folder (the EAGLE head goes to draft.safetensors)
    ck.save_checkpoint(tmp_path, {"step": 1, "draft": state}, {})
    _, got = ck.load_checkpoint(tmp_path)
    assert got.state is not None and _equal(got.state["draft"], state)
    assert (tmp_path / "checkpoints/step-000001/draft.safetensors").is_file() == (name == "eagle")
    fresh = _construct(cls, policy, {}, {})
    fresh.load_state_dict(got.state["draft"])
    assert _equal(fresh.state_dict(), state)


def test_the_model_folder_loads_with_from_pretrained_and_trains_again(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, dense_reward: None
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(overrides=tiny_overrides(tiny_model_dir, tmp_path, name="r", steps=2))
    run = train(cfg.with_reference_parts()).run_dir
    model_dir = run / "model"
    for f in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (model_dir / f).is_file(), f
    # loadable by every transformers release in range: 4.x has no TokenizersBackend class
    assert (
        json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"]
        != "TokenizersBackend"
    )
    exported = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    initial = {k: v.clone() for k, v in trained.state_dict().items()}
    trained.load_state_dict(load_file(run / "checkpoints/step-000002/policy.safetensors"))
    assert not _equal(initial, trained.state_dict()), "the run did not change the weights"
    ids = AutoTokenizer.from_pretrained(model_dir)(["12+34+5="], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=0)
    rc = main(["train", "--reference", "--model", str(model_dir), "--out-dir", str(tmp_path), "--name", "again",
               "--steps", "1", "--set", "prompts_per_step=2", "--set", "group_size=4", "--set", "max_new_tokens=4",
               "--set", "task.name=arithmetic", "--set", "task.num_eval=4", "--set", "threads=1", "--no-progress",
               "-q"])  # fmt: skip
    assert rc == 0
    assert json.loads((tmp_path / "again" / "status.json").read_text())["status"] == "completed"
