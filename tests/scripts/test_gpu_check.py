"""scripts/gpu/gpu_check.sh: ``--dry-run`` (what CI can check without a GPU) and its summary writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_lists_every_step_and_passes_its_checks(tmp_path: Path) -> None:
    # this interpreter's venv first on PATH: the script calls `grpo-parts`, which must be this venv's
    # (scripts/ci/test-install.sh runs the suite with a venv's python, not an activated venv)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_PYTHON": sys.executable, "PATH": path}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu" / "gpu_check.sh"), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for step in ("e2e", "vlm_attention", "verl_prefix", "vllm", "vllm_online", "verl_smoke", "openrlhf"):
        assert f"[{step}" in proc.stdout
    assert "--device cuda --preset h200" in proc.stdout
    assert (
        sum(int(line.split("<=")[1].split("s]")[0]) for line in proc.stdout.splitlines() if "<=" in line)
        <= 510  # 8.5 minutes of steps: with the machine's start, inside a task's 15 minutes of device time
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["passed"]
    assert {s["name"] for s in report["steps"]} >= {
        "dry_imports",
        "dry_e2e_args",
        "dry_vlm_attention_args",
        "dry_openrlhf_script",
        "dry_vllm_online_configs",
    }
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check (dry run)")


def test_summary_of_a_run_reads_each_steps_numbers(tmp_path: Path) -> None:
    steps = [
        {"name": "e2e", "limit_s": 200, "rc": 0, "seconds": 150.0, "command": "grpo-parts bench e2e"},
        {"name": "verl_prefix", "limit_s": 90, "rc": 0, "seconds": 60.0, "command": "verl_prefix_bench"},
        {"name": "openrlhf", "limit_s": 60, "rc": 124, "seconds": 60.0, "command": "openrlhf smoke"},
    ]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    arms = {
        "reference": {"tokens_per_s_per_gpu": 1000.0, "step_s": 9.0},
        "optimized": {"tokens_per_s_per_gpu": 3000.0, "step_s": 3.0},
    }
    (tmp_path / "e2e.json").write_text(json.dumps({"arms": arms, "step_speedup": 3.0}))
    bench = {"results": {"verl_packed": {"update_s_median": 1.5, "model_tokens": 4333}}}
    (tmp_path / "verl_prefix.log").write_text("| table |\n" + json.dumps(bench) + "\n")
    (tmp_path / "openrlhf.log").write_text("Terminated\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "gpu_check_summary.py"), str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1  # a step timed out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not report["passed"] and report["total_seconds"] == 270.0
    by = {s["name"]: s for s in report["steps"]}
    assert by["e2e"]["result"]["step_speedup"] == 3.0 and by["openrlhf"]["result"] == {
        "log_tail": ["Terminated"]
    }
    md = (tmp_path / "gpu_check.md").read_text()
    assert (
        "optimized: 3000 tok/s/GPU" in md and "verl_packed: 1.50 s, 4333 tokens" in md and "NO (rc 124)" in md
    )
