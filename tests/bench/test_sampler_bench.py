"""``grpo-parts bench sampler`` smoke tests: the JSON contract and the task-policy cache."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpo_parts.bench import sampler as bench


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_quick_bench_writes_the_contract_keys(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    args = _args(
        "--quick", "--samplers", "reference,speculative", "--spec-drafts", "ngram,eagle", "--spec-warmup", "1",
        "--hidden", "32", "--layers", "2", "--vocab", "64", "--modes", "sample", "--json", str(out),
    )  # fmt: skip
    assert bench.run(args) == 0
    points = json.loads(out.read_text())["points"]
    spec = [p for p in points if p["sampler"] == "speculative"]
    assert {p["draft"] for p in spec} == {"ngram", "eagle"}
    for p in spec:
        assert {"draft", "batch", "speedup", "accepted_per_verify"} <= set(p)
        assert p["speedup"] > 0 and p["accepted_per_verify"] >= 1.0


def test_task_policy_and_drafts_are_cached(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    argv = (
        "--policy", "task", "--task-steps", "2", "--hidden", "32", "--layers", "2", "--batches", "1",
        "--max-new-tokens", "8", "--repeats", "1", "--modes", "greedy", "--samplers", "reference,speculative",
        "--spec-drafts", "eagle,frozen_lm", "--spec-text-batches", "1", "--spec-warmup", "0",
        "--cache-dir", str(cache),
    )  # fmt: skip
    assert bench.run(_args(*argv)) == 0
    names = sorted(p.name for p in cache.iterdir())
    assert names == [
        "eagle_h32_l2_steps2_seed0_text1_warm0.pt",
        "frozen_lm_h32_l2_steps2_seed0.pt",
        "policy_h32_l2_steps2_seed0.pt",
    ]
    assert bench.run(_args(*argv)) == 0  # second run loads all three
