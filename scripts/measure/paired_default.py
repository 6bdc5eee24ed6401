"""Prompt skipping on against off, seed by seed: the numbers that decide ``grpo-parts train``'s
finite-data default (issue #54, docs/results.md "The finite-data default").

Reads a finished ``grpo-parts train --compare --arms skip_on skip_off --seeds N`` folder (nothing is
re-run) and prints, per arm: medians of time and steps to each target (a seed that never reached it
counts as never), the median final accuracy, how many runs ended more than ``--margin`` under their
pair, and the largest early drop (the largest fall between two consecutive held-out evaluations in
the first half of the run). Then every early drop of at least ``--drop`` with what the skipping arm's
steps between those two evaluations did: the largest ``1 / p`` weight, the share of drawn prompts
skipped and the zero-variance share of the rolled-out groups, beside the other arm's same steps.

    python scripts/measure/paired_default.py runs/compare-A [runs/compare-B ...] --targets 0.44 0.46 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from arms_retarget import compare_runs

from grpo_parts.train.reporting.metrics import eval_curve, final_accuracy, time_to_target

Rows = list[dict[str, Any]]


def _median_never(vals: list[float | None]) -> float | None:
    """The median with "never" (None) as +inf; None when most runs never got there."""
    m = statistics.median([float("inf") if v is None else v for v in vals])
    return None if m == float("inf") else m


def early_drops(rows: Rows) -> list[tuple[int, int, float, float]]:
    """``(step_from, step_to, acc_from, acc_to)`` for consecutive evaluations in the run's first half."""
    curve = eval_curve(rows)
    half = max((c[0] for c in curve), default=0) / 2
    return [(a[0], b[0], a[2], b[2]) for a, b in zip(curve, curve[1:]) if b[0] <= half]


def _between(rows: Rows, lo: int, hi: int) -> dict[str, float | None]:
    """What the steps ``lo < step <= hi`` did: the largest weight, the share skipped, zero-variance share."""
    steps = [r for r in rows if lo < r.get("step", 0) <= hi and "time_step" in r]
    drawn = sum(float(r.get("prompts_drawn", r.get("prompts", 0))) for r in steps)
    weights = [float(r["skip_max_weight"]) for r in steps if r.get("skip_max_weight") is not None]
    zv = [float(r["zero_variance_share"]) for r in steps if r.get("zero_variance_share") is not None]
    return {
        "max_weight": max(weights) if weights else None,
        "skipped_share": sum(float(r.get("prompts_skipped", 0)) for r in steps) / drawn if drawn else 0.0,
        "zero_variance_share": sum(zv) / len(zv) if zv else None,
    }


def summarize_pairs(runs: dict[int, dict[str, Rows]], targets: list[float], margin: float) -> dict[str, Any]:
    """Per arm: medians to each target, final accuracy, low runs against the pair, early drops."""
    arms = list(next(iter(runs.values())))
    out: dict[str, Any] = {"seeds": sorted(runs), "targets": targets, "margin": margin, "arms": {}}
    for arm in arms:
        other = next(a for a in arms if a != arm)
        finals = {s: final_accuracy(r[arm]) for s, r in runs.items()}
        pair = {s: final_accuracy(r[other]) for s, r in runs.items()}
        per_target = {}
        for t in targets:
            hits = {s: time_to_target(r[arm], t) for s, r in runs.items()}
            per_target[str(t)] = {
                "time_s": _median_never([h[1] for h in hits.values()]),
                "steps": _median_never([None if h[0] is None else float(h[0]) for h in hits.values()]),
                "reached": sum(h[0] is not None for h in hits.values()),
                "per_seed_time_s": {str(s): h[1] for s, h in hits.items()},
            }
        drops = {s: max([0.0] + [a - b for _, _, a, b in early_drops(r[arm])]) for s, r in runs.items()}
        out["arms"][arm] = {
            "targets": per_target,
            "final_accuracy": statistics.median(v for v in finals.values() if v is not None),
            "per_seed_final": {str(s): v for s, v in finals.items()},
            "ended_low": sum(
                1
                for s in runs
                if None not in (finals[s], pair[s]) and finals[s] < pair[s] - margin  # type: ignore[operator]
            ),
            "largest_early_drop": max(drops.values()),
            "median_early_drop": statistics.median(drops.values()),
            "per_seed_early_drop": {str(s): d for s, d in drops.items()},
        }
    return out


def drop_table(runs: dict[int, dict[str, Rows]], skip_arm: str, at_least: float) -> list[dict[str, Any]]:
    """Every early drop of ``at_least`` or more in any arm, with what both arms' steps in between did."""
    found = []
    for seed, arms in runs.items():
        for arm, rows in arms.items():
            for lo, hi, a, b in early_drops(rows):
                if a - b >= at_least:
                    found.append(
                        {
                            "seed": seed,
                            "arm": arm,
                            "steps": f"{lo}-{hi}",
                            "accuracy": f"{a:.3f} -> {b:.3f}",
                            skip_arm: _between(arms[skip_arm], lo, hi),
                            **{o: _between(arms[o], lo, hi) for o in arms if o != skip_arm},
                        }
                    )
    return found


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "never" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "folders",
        type=Path,
        nargs="+",
        help="compare run folders (each holds seed8/, seed9/, ...), seeds merged",
    )
    ap.add_argument(
        "--targets", type=float, nargs="+", required=True, help="held-out accuracies to report at"
    )
    ap.add_argument("--margin", type=float, default=0.03, help="a run ends low when this far under its pair")
    ap.add_argument("--drop", type=float, default=0.05, help="list early drops at least this large")
    ap.add_argument("--skip-arm", default="skip_on", help="the arm that skips prompts")
    ap.add_argument("--json", type=Path, help="also write the summary and the drops here")
    args = ap.parse_args()
    runs: dict[int, dict[str, Rows]] = {}
    for folder in args.folders:
        more = compare_runs(folder)
        twice = sorted(set(runs) & set(more))
        if twice:
            raise SystemExit(
                f"folders: seed(s) {twice} appear in more than one folder; expected each seed once"
            )
        runs.update(more)
    result = summarize_pairs(runs, args.targets, args.margin)
    result["drops"] = drop_table(runs, args.skip_arm, args.drop)
    for arm, r in result["arms"].items():
        cells = [
            f"to {t}: {_fmt(v['time_s'], '.1f')} s / {_fmt(v['steps'], '.0f')} steps ({v['reached']} reached)"
            for t, v in r["targets"].items()
        ]
        print(
            f"{arm}: " + "; ".join(cells) + f"; final {r['final_accuracy']:.3f}; "
            f"ended low {r['ended_low']}/{len(runs)}; largest early drop {r['largest_early_drop']:.3f}"
        )
    for d in result["drops"]:
        print(json.dumps(d))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
