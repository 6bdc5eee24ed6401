"""``--compare --seeds N``: aggregate the per-seed comparisons (medians, means, phases) and its markdown.
The JSON keys are a contract (tested): docs/training.md, "--compare"."""

from __future__ import annotations

from typing import Any

from ..reporting.metrics import accuracy_goal_met
from .ablation import ablation_lines, aggregate_ablation
from .phases import mean_of, median_of, median_phases

#: per-arm summary fields reported per seed and as medians
ARM_FIELDS = ("time_to_target_s", "steps_to_target", "mean_step_s", "final_accuracy")


def aggregate_seeds(per_seed: list[dict[str, Any]], target: float, seeds: list[int]) -> dict[str, Any]:
    med = median_of([r["speedup_to_target"] for r in per_seed])
    step_med = median_of([r["step_speedup"] for r in per_seed])
    step_mean = mean_of([r["step_speedup"] for r in per_seed])
    diff = mean_of([r["accuracy_diff"] for r in per_seed])
    amdahl = median_of([r["amdahl_bound"] for r in per_seed])
    medians = {
        arm: {f: median_of([r["runs"][arm][f] for r in per_seed]) for f in ARM_FIELDS}
        for arm in ("reference", "optimized")
    }
    efficiency = median_of(
        [
            r["step_speedup"] / r["amdahl_bound"]
            for r in per_seed
            if r["step_speedup"] is not None and r["amdahl_bound"]
        ]
    )
    goals = {
        "median_speedup_to_target_ge_2": (med, med is not None and med >= 2.0),
        # (the key's name predates "or better": an optimized arm more accurate than the reference meets it)
        "mean_accuracy_diff_within_0.03": (diff, accuracy_goal_met(diff)),
        "mean_step_speedup_ge_2": (step_mean, step_mean is not None and step_mean >= 2.0),
        "step_speedup_ge_0.8_amdahl": (efficiency, efficiency is not None and efficiency >= 0.8),
    }
    ablation = aggregate_ablation(per_seed)
    if ablation:  # the stronger check: measured vs the speedup the parts' isolated gains predict
        comp = ablation["composition"]
        goals["composition_ge_0.8"] = (comp, comp is not None and comp >= 0.8)
    return {
        "target_accuracy": target,
        "seeds": seeds,
        "speedup_to_target": med,
        "step_speedup": step_med,
        "accuracy_diff": diff,
        "rollout_share": median_of([r["rollout_share"] for r in per_seed]),
        "amdahl_bound": amdahl,
        "phases": median_phases(per_seed),
        "medians": medians,
        **ablation,
        "goals": {k: {"value": v, "met": ok} for k, (v, ok) in goals.items()},
        "median_speedup_to_target": med,
        "speedups_to_target": [r["speedup_to_target"] for r in per_seed],
        "mean_step_speedup": step_mean,
        "mean_final_accuracy_diff": diff,
        "passes": bool(med is not None and med >= 3.0 and accuracy_goal_met(diff)),
        "per_seed": per_seed,
    }


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def seeds_markdown(result: dict[str, Any]) -> list[str]:
    from ..reporting.report import phase_lines

    lines = [
        f"# Reference vs optimized parts over {len(result['seeds'])} seeds",
        "",
        "| seed | time to target ref / opt (s) | **speedup to target** | steps to target ref / opt "
        "| step ref / opt (s) | **step speedup** | Amdahl bound | final acc ref / opt | difference |",
        "|---:|---|---:|---|---|---:|---:|---|---:|",
    ]
    for s, r in zip(result["seeds"], result["per_seed"]):
        ref, opt = r["runs"]["reference"], r["runs"]["optimized"]
        lines.append(
            f"| {s} | {_f(ref['time_to_target_s'], '.1f')} / {_f(opt['time_to_target_s'], '.1f')} "
            f"| {_f(r['speedup_to_target'])}x | {_f(ref['steps_to_target'], 'd')} / {_f(opt['steps_to_target'], 'd')} "
            f"| {_f(ref['mean_step_s'], '.3f')} / {_f(opt['mean_step_s'], '.3f')} | {_f(r['step_speedup'])}x "
            f"| {_f(r['amdahl_bound'])}x | {_f(ref['final_accuracy'], '.3f')} / {_f(opt['final_accuracy'], '.3f')} "
            f"| {_f(r['accuracy_diff'], '+.3f')} |"
        )
    m = result["medians"]
    lines.append(
        f"| median | {_f(m['reference']['time_to_target_s'], '.1f')} / {_f(m['optimized']['time_to_target_s'], '.1f')} "
        f"| {_f(result['speedup_to_target'])}x | {_f(m['reference']['steps_to_target'], 'g')} / "
        f"{_f(m['optimized']['steps_to_target'], 'g')} | {_f(m['reference']['mean_step_s'], '.3f')} / "
        f"{_f(m['optimized']['mean_step_s'], '.3f')} | {_f(result['step_speedup'])}x | {_f(result['amdahl_bound'])}x "
        f"| {_f(m['reference']['final_accuracy'], '.3f')} / {_f(m['optimized']['final_accuracy'], '.3f')} "
        f"| {_f(result['accuracy_diff'], '+.3f')} (mean) |"
    )
    lines += ["", "Phases (medians over seeds):", "", *phase_lines(result), ""]
    if result.get("ablation"):
        lines += ["Ablation, medians over seeds (accuracy difference: mean).", "", *ablation_lines(result)]
    lines += ["Goals:", ""]
    for name, g in result["goals"].items():
        lines.append(f"- {name}: {_f(g['value'], '.3f')} -> {'met' if g['met'] else 'not met'}")
    return lines
