#!/usr/bin/env python
"""Summary of ``scripts/gpu/gpu_check.sh``: reads ``OUT/steps.jsonl`` (one record per step: name, limit_s,
rc, seconds, command) and each step's outputs, writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``.

JSON keys: ``date``, ``machine`` (GPU name, torch and CUDA versions), ``dry_run``, ``passed``,
``total_seconds``, ``steps`` (the records, each with ``ok`` and its ``result``: the e2e JSON, the verl
prefix benchmark's JSON line, the smoke scripts' JSON reports, the last log lines otherwise).

    python scripts/gpu/gpu_check_summary.py OUT [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path
from typing import Any

#: step -> the file its result is read from (relative to OUT); others: the last JSON line of its log
RESULT_FILES = {
    "e2e": "e2e.json",
    "vlm_attention": "attention_vlm.json",
    "vllm_online": "vllm_online.json",
    "verl_smoke": "verl_smoke.json",
    "openrlhf": "openrlhf_smoke.json",
}


def machine() -> dict[str, Any]:
    out: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # noqa: BLE001 - a summary must still be written
        out["torch"] = f"unavailable: {e}"
    return out


def step_result(out: Path, name: str) -> Any:
    path = out / RESULT_FILES.get(name, "")
    if name in RESULT_FILES and path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            return {"unreadable": f"{path.name}: {e}"}
    log = out / f"{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    return {"log_tail": lines[-15:]}


def headline(name: str, result: Any) -> str:
    """One line of numbers per step for the markdown summary."""
    if name == "vlm_attention" and isinstance(result, list):  # the attention bench's points
        return "; ".join(
            f"{r.get('image_tokens')} image tokens, S={r.get('S')}: {r.get('speedup') or float('nan'):.2f}x, "
            f"memory {r.get('memory_ratio') or float('nan'):.2f}x"
            for r in result
            if isinstance(r, dict)
        )
    if not isinstance(result, dict):
        return ""
    if name == "e2e" and "arms" in result:
        arms = result["arms"]
        return "; ".join(
            f"{a}: {v.get('tokens_per_s_per_gpu', float('nan')):.0f} tok/s/GPU, step {v.get('step_s', float('nan')):.1f} s"
            for a, v in arms.items()
            if isinstance(v, dict)
        ) + (f"; step speedup {result['step_speedup']:.2f}x" if "step_speedup" in result else "")
    if name == "vllm_online" and "arms" in result:
        return "; ".join(
            f"{a}: {v.get('tokens_per_s', float('nan')):.0f} tok/s (x{v.get('speedup_vs_static') or float('nan'):.2f})"
            + (
                f", acceptance {v['acceptance_first_last'][0]:.2f} -> {v['acceptance_first_last'][1]:.2f}"
                if "acceptance_first_last" in v
                else ""
            )
            for a, v in result["arms"].items()
            if isinstance(v, dict)
        )
    if name == "verl_prefix" and "results" in result:
        return "; ".join(
            f"{v}: {r['update_s_median']:.2f} s, {r['model_tokens']} tokens"
            for v, r in result["results"].items()
            if "update_s_median" in r
        )
    if "checks" in result:
        failed = [k for k, ok in result["checks"].items() if not ok]
        return f"checks failed: {failed}" if failed else f"{len(result['checks'])} checks passed"
    return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="gpu_check.sh's output folder (reads OUT/steps.jsonl)")
    p.add_argument(
        "--dry-run", action="store_true", help="summarize a --dry-run of gpu_check.sh (no GPU steps)"
    )
    args = p.parse_args()
    steps_file = args.out / "steps.jsonl"
    if not steps_file.is_file():
        print(f"steps: expected {steps_file} (written by scripts/gpu/gpu_check.sh), got nothing")
        return 2
    steps = [json.loads(line) for line in steps_file.read_text().splitlines() if line.strip()]
    for s in steps:
        s["ok"] = s["rc"] == 0
        if not args.dry_run:
            s["result"] = step_result(args.out, s["name"])
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "dry_run": args.dry_run,
        "passed": all(s["ok"] for s in steps),
        "total_seconds": round(sum(s["seconds"] for s in steps), 1),
        "steps": steps,
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    m = report["machine"]
    md = [
        f"# GPU check {'(dry run) ' if args.dry_run else ''}{report['date']}",
        "",
        f"Machine: {m.get('gpu') or 'no GPU'}, torch {m.get('torch')}, CUDA {m.get('cuda')}. "
        f"Total {report['total_seconds']} s. {'All steps passed.' if report['passed'] else 'Some steps FAILED.'}",
        "",
        "| step | ok | seconds (limit) | numbers | command |",
        "|---|---|---|---|---|",
    ]
    for s in steps:
        nums = headline(s["name"], s.get("result"))
        md.append(
            f"| {s['name']} | {'yes' if s['ok'] else 'NO (rc ' + str(s['rc']) + ')'} | {s['seconds']} "
            f"({s['limit_s']}) | {nums} | `{s['command']}` |"
        )
    (args.out / "gpu_check.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
