"""The arms of a finished ``grpo-parts train --compare --arms ...`` run at other target accuracies.

Time to target depends on the target: one near the plateau that most seeds of an arm never reach
leaves no median, one reached at the first evaluation measures nothing. This re-reads each seed's
``metrics.jsonl`` (nothing is re-run) and prints the arms' medians at each target, so a results page
can show how the comparison moves with it.

    python scripts/measure/arms_retarget.py runs/compare-YYYYMMDD-HHMMSS --targets 0.8 0.82 0.85 --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from grpo_parts.train.experiments.arms import aggregate_arms, arm_summary, arms_markdown
from grpo_parts.train.reporting.metrics import read_metrics


def compare_runs(folder: Path) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """``{seed: {arm: rows}}`` of a compare folder (``seedN/<arm>/`` or one seed's ``<arm>/``)."""
    seeds = sorted(folder.glob("seed*/")) or [folder]
    out: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for i, d in enumerate(seeds):
        order = d / "arms.json"  # the compare's own arm order, when the seed finished
        names = list(json.loads(order.read_text())["arms"]) if order.exists() else None
        found = {m.parent.name: m for m in sorted(d.glob("*/metrics.jsonl"))}
        arms = {a: read_metrics(found[a]) for a in (names or found) if a in found}
        if arms:
            out[int(d.name[4:]) if d.name.startswith("seed") else i] = arms
    if not out:
        raise SystemExit(
            f"folder: no <arm>/metrics.jsonl under {folder}; expected a --compare --arms run folder"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "folder", type=Path, help="the compare run folder (holds seed0/, seed1/, ... or the arms)"
    )
    ap.add_argument(
        "--targets", type=float, nargs="+", required=True, help="held-out accuracies to report at"
    )
    ap.add_argument("--json", type=Path, help="also write {target: medians} here")
    args = ap.parse_args()
    runs = compare_runs(args.folder)
    seeds = sorted(runs)
    out = {}
    for target in args.targets:
        per_seed = [
            {"target_accuracy": target, "arms": {a: arm_summary(rows, target) for a, rows in runs[s].items()}}
            for s in seeds
        ]
        result = aggregate_arms(per_seed, seeds)
        out[str(target)] = {a: v for a, v in result["arms"].items()}
        print("\n".join(arms_markdown(result)) + "\n")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
