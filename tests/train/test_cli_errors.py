"""`grpo-parts train` refuses bad input in one line on stderr (exit 2, no traceback) and leaves an
existing run folder byte for byte as it was: an --out-dir that is a file, damaged checkpoints, a
pickled object in a checkpoint, bad part kwargs, resume with fewer steps, a run still running."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import QUIET, refused, snapshot

from grpo_parts.cli import main


def test_out_dir_that_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, old: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("not a folder\n")
    before = snapshot(old)
    refused(capsys, ["--out-dir", str(f), "--name", "x"], f"out_dir: {str(f)!r} is a file")
    refused(capsys, ["--out-dir", str(old / "report.md")], "is a file")
    refused(capsys, ["--out-dir", str(tmp_path), "--name", "afile"], f"name: {str(f)!r} is a file")
    assert f.read_text() == "not a folder\n" and snapshot(old) == before


def _damage(path: Path, data: bytes) -> None:
    """Replace a checkpoint file and record its new size, so that only its content is wrong."""
    path.write_bytes(data)
    meta_path = path.parent / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][path.name] = len(data)
    meta_path.write_text(json.dumps(meta))


class Evil:
    """Stands for any object a pickle could smuggle in (its __reduce__ could run code)."""


def _pickled_object() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"step": 3, "x": Evil()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "case", ["truncated-weights", "garbage-state", "pickled-object", "bad-pointer", "bad-meta"]
)
def test_damaged_checkpoint_names_the_file_and_the_intact_one(
    capsys: pytest.CaptureFixture[str], old: Path, case: str
) -> None:
    last, prev = old / "checkpoints" / "step-000003", old / "checkpoints" / "step-000002"
    bad, what = {
        "truncated-weights": (last / "policy.safetensors", "is truncated or damaged"),
        "garbage-state": (last / "state.pt", "is corrupt or truncated"),
        "pickled-object": (last / "state.pt", "holds a pickled test_cli_errors.Evil"),
        "bad-pointer": (old / "checkpoints" / "last", "is missing or damaged"),
        "bad-meta": (last / "checkpoint.json", "is corrupt or truncated"),
    }[case]
    if case == "truncated-weights":
        bad.write_bytes(bad.read_bytes()[:1000])
    elif case == "garbage-state":
        _damage(bad, bytes(range(256)) * 40)
    elif case == "pickled-object":
        _damage(bad, _pickled_object())
    else:
        bad.write_text('{"step": 3, "conf')
    before = snapshot(old)
    line = refused(capsys, ["--resume", str(old), "--steps", "4"], f"resume: {bad} {what}")
    if case == "pickled-object":
        assert "weights_only=True" in line
    intact = prev if case != "bad-pointer" else last
    step = int(intact.name.removeprefix("step-"))
    assert line.endswith(f"{intact} (step {step}) is intact: grpo-parts train --resume {intact}")
    assert snapshot(old) == before


@pytest.mark.parametrize(
    ("kwarg", "fragments"),
    [
        ("parts.sampler_kwargs.foo=1", ["parts.sampler_kwargs.foo: sampler 'speculative' has no argument 'foo' (got 1)", "max_draft_tokens"]),
        ("parts.sampler_kwargs.max_draft_tokens=0", ["parts.sampler_kwargs.max_draft_tokens: Input should be greater than or equal to 1, got 0 (sampler 'speculative')"]),
        ("parts.draft_kwargs.max_ngram=abc", ["parts.draft_kwargs.max_ngram: expected int, got 'abc' (draft 'ngram')"]),
        ("parts.draft_kwargs.max_ngram=-1", ["parts.draft_kwargs: draft 'ngram' rejected {'max_ngram': -1}: min_ngram/max_ngram: expected 1 <= min_ngram <= max_ngram"]),
        ("parts.filter_kwargs.pruning_rate=1.5", ["parts.filter_kwargs.pruning_rate: Input should be less than 1, got 1.5 (filter 'cppo')"]),
        ("parts.attention_kwargs.kernel=bogus", ["parts.attention_kwargs: attention 'shared_prefix' rejected {'kernel': 'bogus'}: kernel: expected"]),
    ],
    ids=["unknown", "range", "type", "constructor-rule", "filter-range", "attention-value"],
)  # fmt: skip
def test_bad_part_kwargs(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, old: Path, kwarg: str, fragments: list[str]
) -> None:
    before = snapshot(old)
    argv = ["--model", str(tiny_model_dir), "--out-dir", str(old.parent), "--name", "new", "--set", kwarg]
    refused(capsys, argv, *fragments)
    assert not (old.parent / "new").exists() and snapshot(old) == before


def test_resume_with_fewer_steps_or_nothing_left(capsys: pytest.CaptureFixture[str], old: Path) -> None:
    before = snapshot(old)
    refused(
        capsys,
        ["--resume", str(old), "--steps", "2"],
        "--steps 2 is below the 3 steps",
        "expected --steps >= 3",
    )
    refused(capsys, ["--resume", str(old)], "has completed its 3 steps; pass --steps N with N > 3")
    refused(capsys, ["--resume", str(old), "--seed", "4"], "resume: --seed cannot change a run being resumed")
    assert snapshot(old) == before


def _mark_running(run: Path, pid: int, host: str | None = None) -> None:
    """status.json as a run that is (or was, until killed) training as ``pid`` on ``host`` writes it."""
    status = json.loads((run / "status.json").read_text())
    status.update(status="running", pid=pid, pid_start=None, host=host or socket.gethostname())
    (run / "status.json").write_text(json.dumps(status))


def test_resume_refuses_a_live_pid_and_takes_over_a_dead_one(
    capsys: pytest.CaptureFixture[str], old: Path
) -> None:
    with subprocess.Popen(["sleep", "60"]) as proc:
        _mark_running(old, proc.pid)
        before = snapshot(old)
        refused(
            capsys, ["--resume", str(old), "--steps", "4"], f"is still running (pid {proc.pid} on this host)"
        )
        assert snapshot(old) == before
        proc.kill()
    _mark_running(old, proc.pid, host="elsewhere")
    refused(capsys, ["--resume", str(old), "--steps", "4"], "on host 'elsewhere'", "cannot be checked from")
    _mark_running(old, proc.pid)  # a dead pid: a run killed without a word
    assert main(["train", "--resume", str(old), "--steps", "4", *QUIET]) == 0
    assert json.loads((old / "status.json").read_text())["status"] == "completed"


def test_resume_with_more_steps_rewrites_config_yaml(old: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="grpo_parts.train"):
        assert main(["train", "--resume", str(old), "--steps", "5", "--no-progress"]) == 0
    assert "config.yaml: steps 3 -> 5 (resumed with --steps)" in caplog.text
    assert "steps: 5\n" in (old / "config.yaml").read_text()
    rows: list[dict[str, Any]] = [json.loads(x) for x in (old / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
