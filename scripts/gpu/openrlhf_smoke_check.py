"""Check the numbers of an OpenRLHF GPU smoke run (scripts/gpu/openrlhf_gpu_smoke.sh) and write them as JSON.

``python scripts/gpu/openrlhf_smoke_check.py OUT_DIR CONFIG... [--json PATH]`` reads ``OUT_DIR/<config>.log``
(and ``OUT_DIR/<config>.rc``, the run's exit status), takes every step dict OpenRLHF logs
(``Global step N: {...}``) and checks, per configuration:

* at least one step was logged, and every logged ``policy_loss`` is finite (at least one);
* every part the configuration switches on ran (``parts/<part>/<calls>`` summed over steps > 0)
  and never fell back (``parts/<part>/fallbacks`` == 0);
* where attention is on: the first batch's log-probs with and without the part agree
  (``parts/attention/first_batch_logprob_max_abs_diff`` <= ``--logprob-tol``; the runs use
  ``--grpo_parts.check_first_batch 1``).

Writes ``{"configs": {config: {"ok", "failures", "steps", "numbers"}}, "ok"}`` to ``--json`` and
exits 1 when any check fails. Pure Python (no GPU): tests/adapters/openrlhf/test_openrlhf_smoke.py
runs it on OpenRLHF's own log lines.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

#: configuration -> parts it switches on (see set_extra in openrlhf_gpu_smoke.sh)
SWITCHED_ON: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "filter": ("filter",),
    "attention": ("attention",),
    "attention_packed": ("attention",),
    "speculative": ("sampler",),
    "all": ("filter", "attention", "sampler"),
}
UNITS = {"sampler": "rollouts", "attention": "forwards", "filter": "calls"}
FIRST_BATCH = "parts/attention/first_batch_logprob_max_abs_diff"
STEP = re.compile(r"Global step (\d+): (\{.*\})\s*$")
NONFINITE = re.compile(r"(?<![\w'\"])(-?)(inf|nan)(?![\w'\"])")


def _literal(text: str) -> Any:
    """``repr`` of a status dict -> dict (``inf`` -> float inf, ``nan`` -> the string ``'nan'``)."""
    return ast.literal_eval(NONFINITE.sub(lambda m: f"{m[1]}1e999" if m[2] == "inf" else "'nan'", text))


def steps_in(log: str) -> list[dict[str, Any]]:
    """The status dicts OpenRLHF's ``PPOTrainer.fit`` logs, in order."""
    out = []
    for line in log.splitlines():
        m = STEP.search(line)
        if m:
            try:
                out.append(_literal(m.group(2)))
            except (ValueError, SyntaxError):
                out.append({"unparsed": m.group(2)[:200]})
    return out


def check(config: str, log: str, rc: int | None, logprob_tol: float) -> dict[str, Any]:
    steps = steps_in(log)
    failures: list[str] = []
    numbers: dict[str, Any] = {"exit_status": rc}
    if rc not in (0, None):
        failures.append(f"exit status {rc}")
    if not steps:
        failures.append("no step logged")
    losses = [s.get("policy_loss") for s in steps if "policy_loss" in s]
    numbers["policy_loss"] = losses
    if steps and not losses:
        failures.append("no policy_loss logged")
    bad = [x for x in losses if not isinstance(x, (int, float)) or not math.isfinite(x)]
    if bad:
        failures.append(f"policy_loss not finite: {bad}")
    for part in SWITCHED_ON[config]:
        ran = sum(float(s.get(f"parts/{part}/{UNITS[part]}", 0.0)) for s in steps)
        fell = sum(float(s.get(f"parts/{part}/fallbacks", 0.0)) for s in steps)
        numbers[f"parts/{part}/{UNITS[part]}"], numbers[f"parts/{part}/fallbacks"] = ran, fell
        if ran <= 0:
            failures.append(f"{part}: no call went through it (parts/{part}/{UNITS[part]} = {ran})")
        if fell:
            failures.append(f"{part}: {fell:g} call(s) fell back to OpenRLHF's path")
    if "attention" in SWITCHED_ON[config]:
        diffs = [s[FIRST_BATCH] for s in steps if FIRST_BATCH in s]
        numbers[FIRST_BATCH] = diffs[0] if diffs else None
        if not diffs:
            failures.append(f"{FIRST_BATCH} not logged (run with --grpo_parts.check_first_batch 1)")
        elif not diffs[0] <= logprob_tol:
            failures.append(f"first batch log-probs differ by {diffs[0]:.3g} > {logprob_tol:g}")
    numbers["steps"] = len(steps)
    return {"ok": not failures, "failures": failures, "steps": len(steps), "numbers": numbers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="the smoke run's folder (OUT_DIR/<config>.log and .rc)")
    p.add_argument("configs", nargs="+", choices=sorted(SWITCHED_ON), help="the configurations that ran")
    p.add_argument("--json", type=Path, default=None, help="where to write the results")
    p.add_argument("--logprob-tol", type=float, default=0.05, help="bf16 log-prob tolerance")
    p.add_argument("--meta", default="{}", help="JSON merged into the output (versions, GPU)")
    a = p.parse_args(argv)
    results = {}
    for cfg in a.configs:
        log_path, rc_path = a.out_dir / f"{cfg}.log", a.out_dir / f"{cfg}.rc"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        rc = int(rc_path.read_text().strip()) if rc_path.exists() else None
        results[cfg] = check(cfg, log, rc, a.logprob_tol)
        status = "ok" if results[cfg]["ok"] else "FAILED: " + "; ".join(results[cfg]["failures"])
        print(f"{cfg}: {results[cfg]['steps']} step(s), {status}")
    out = {"ok": all(r["ok"] for r in results.values()), "configs": results, **json.loads(a.meta)}
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
