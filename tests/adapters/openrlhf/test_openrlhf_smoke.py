"""The CPU-checkable pieces of scripts/gpu/openrlhf_gpu_smoke.sh: its syntax, its configurations, and
scripts/gpu/openrlhf_smoke_check.py (the numbers it asserts) on OpenRLHF's own step log."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu" / "openrlhf_gpu_smoke.sh"


def checker():
    spec = importlib.util.spec_from_file_location(
        "openrlhf_smoke_check", ROOT / "scripts" / "gpu" / "openrlhf_smoke_check.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_smoke_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_smoke_configs_match_the_checker():
    text = SCRIPT.read_text()
    cases = set(re.findall(r"^\s+(\w+)\) extra=", text, flags=re.M))
    assert cases == set(checker().SWITCHED_ON)
    assert "--grpo_parts.check_first_batch 1" in text  # the attention check needs it


def step_line(n, **status):
    return f"INFO 11-30 15:16:33 ppo_trainer.py:551] ✨ Global step {n}: {status!r}"


def run(tmp_path, config, lines, rc=0):
    (tmp_path / f"{config}.log").write_text("\n".join(lines) + "\n")
    (tmp_path / f"{config}.rc").write_text(f"{rc}\n")
    out = tmp_path / "smoke.json"
    code = checker().main([str(tmp_path), config, "--json", str(out)])
    return code, json.loads(out.read_text())["configs"][config]


GOOD = {"policy_loss": 0.1, "parts/attention/forwards": 4.0, "parts/attention/fallbacks": 0.0,
        "parts/attention/first_batch_logprob_max_abs_diff": 0.01}  # fmt: skip


def test_checker_passes_good_numbers(tmp_path):
    code, res = run(
        tmp_path, "attention", [step_line(1, **GOOD), step_line(2, **{**GOOD, "policy_loss": -0.2})]
    )
    assert code == 0 and res["ok"] and res["steps"] == 2
    assert res["numbers"]["parts/attention/forwards"] == 8.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"parts/attention/fallbacks": 1.0}, "fell back"),
        ({"parts/attention/forwards": 0.0}, "no call went through it"),
        ({"policy_loss": float("nan")}, "not finite"),
        ({"parts/attention/first_batch_logprob_max_abs_diff": 0.5}, "first batch log-probs differ"),
    ],
)
def test_checker_fails_bad_numbers(tmp_path, change, message):
    code, res = run(tmp_path, "attention", [step_line(1, **{**GOOD, **change})])
    assert code == 1 and not res["ok"] and any(message in f for f in res["failures"])


def test_checker_fails_a_run_without_steps_even_with_exit_status_0(tmp_path):
    code, res = run(tmp_path, "baseline", ["Traceback ...", "but the process exited 0"])
    assert code == 1 and res["failures"] == ["no step logged"]


def test_checker_on_openrlhfs_own_log_of_a_run_with_every_part(cpu_run, tmp_path):
    """The log of the CPU default-configuration run (test_openrlhf_deepspeed's worker): OpenRLHF's
    PPOTrainer.fit logged it; the checker reads every part as run, with no fallback."""
    code, res = run(tmp_path, "all", cpu_run["log"].splitlines())
    assert code == 0, res["failures"]
    assert res["numbers"]["parts/sampler/rollouts"] > 0 and res["numbers"]["parts/filter/calls"] > 0
