"""``--compare --ablate``: each optimized part alone, and the step speedup its isolated gains predict.

The comparison's own ``amdahl_bound`` uses phase ratios measured with all parts on, so it cannot
show parts that undo each other (CPPO keeping two rows of a group leaves shared-prefix attention
less to share): ``composition = step_speedup / amdahl_isolated`` can (docs/training.md, "--compare").
"""

from __future__ import annotations

from typing import Any

from ..config import REFERENCE_PARTS, TrainConfig
from ..reporting.report_format import fmt
from .phases import PHASES, mean_of, median_of

#: ablation arm -> the PartsConfig fields it takes from the optimized config
PART_FIELDS: dict[str, tuple[str, ...]] = {
    "sampler": ("sampler", "draft", "sampler_kwargs", "draft_kwargs"),
    "attention": ("attention", "attention_kwargs"),
    "filter": ("filter", "filter_kwargs", "refill_rounds"),
}
#: prefix of an ablation arm's name (its run folder is ``<compare>/only_<part>``)
PREFIX = "only_"


def ablation_configs(config: TrainConfig) -> dict[str, TrainConfig]:
    """``{"only_<part>": config}`` for each part the optimized config sets to a non-reference value."""
    ref = config.with_reference_parts()
    arms: dict[str, TrainConfig] = {}
    for part, fields in PART_FIELDS.items():
        if getattr(config.parts, part) == REFERENCE_PARTS[part]:
            continue
        swapped = ref.parts.model_copy(update={f: getattr(config.parts, f) for f in fields})
        arms[PREFIX + part] = ref.model_copy(update={"parts": swapped})
    return arms


def _phase_s(summary: dict[str, Any], phase: str) -> float:
    return float(summary.get(PHASES[phase]) or 0.0)


def isolated_bound(sums: dict[str, dict[str, Any]], step_speedup: float | None) -> dict[str, Any]:
    """``ablation`` (per arm: phase ratios, step speedup, final accuracy), ``amdahl_isolated`` and
    ``composition`` from the run summaries of ``reference``, ``optimized`` and the ``only_*`` arms."""
    ref = sums["reference"]
    arms = {k: v for k, v in sums.items() if k.startswith(PREFIX)}
    t_ref = float(ref["mean_step_s"] or 0.0)
    per_arm: dict[str, Any] = {}
    for name, s in arms.items():
        ratios = {p: (_phase_s(ref, p) / _phase_s(s, p) if _phase_s(s, p) > 0 else None) for p in PHASES}
        per_arm[name] = {
            "phase_ratios": ratios,
            "step_speedup": t_ref / s["mean_step_s"] if s["mean_step_s"] else None,
            "final_accuracy": s["final_accuracy"],
            "accuracy_diff": None
            if s["final_accuracy"] is None or ref["final_accuracy"] is None
            else s["final_accuracy"] - ref["final_accuracy"],
        }
    predicted: dict[str, float] = {}
    for p in PHASES:
        t = r = _phase_s(ref, p)
        if r > 0:
            for s in arms.values():
                t *= _phase_s(s, p) / r
        predicted[p] = t
    named_ref = sum(_phase_s(ref, p) for p in PHASES)
    total = sum(predicted.values()) + max(t_ref - named_ref, 0.0)
    bound = t_ref / total if total > 0 and arms else None
    return {
        "ablation": {"arms": per_arm, "predicted_phases_s": predicted},
        "amdahl_isolated": bound,
        "composition": step_speedup / bound if bound and step_speedup else None,
    }


def ablation_lines(result: dict[str, Any]) -> list[str]:
    """Markdown: each part alone (phase ratios, step speedup, accuracy) and the composed prediction."""
    ab = result.get("ablation")
    if not ab:
        return []
    lines = [
        "Each part alone (the reference with only that part swapped in; ratio = reference / arm):",
        "",
        "| arm | " + " | ".join(PHASES) + " | step speedup | final acc | vs reference |",
        "|---|" + "---:|" * (len(PHASES) + 3),
    ]
    for name, a in ab["arms"].items():
        cells = " | ".join(f"{fmt(a['phase_ratios'][p], '.2f')}x" for p in PHASES)
        lines.append(
            f"| {name} | {cells} | {fmt(a['step_speedup'], '.2f')}x | {fmt(a['final_accuracy'], '.3f')} "
            f"| {fmt(a['accuracy_diff'], '+.3f')} |"
        )
    return [
        *lines,
        "",
        f"Composed from the isolated ratios, Amdahl predicts {fmt(result['amdahl_isolated'], '.2f')}x; "
        f"measured {fmt(result['step_speedup'], '.2f')}x; composition (measured / predicted) "
        f"{fmt(result['composition'], '.2f')}.",
        "",
    ]


def aggregate_ablation(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Over seeds: the medians of ``amdahl_isolated``, ``composition`` and each arm's phase ratios and
    step speedup, and each arm's mean accuracy difference ({} when no seed ran the ablation)."""
    runs = [r for r in per_seed if r.get("ablation")]
    if not runs:
        return {}
    arms: dict[str, Any] = {}
    for name in runs[0]["ablation"]["arms"]:
        rows = [r["ablation"]["arms"][name] for r in runs if name in r["ablation"]["arms"]]
        arms[name] = {
            "phase_ratios": {p: median_of([a["phase_ratios"][p] for a in rows]) for p in PHASES},
            "step_speedup": median_of([a["step_speedup"] for a in rows]),
            "final_accuracy": median_of([a["final_accuracy"] for a in rows]),
            "accuracy_diff": mean_of([a["accuracy_diff"] for a in rows]),
        }
    return {
        "ablation": {"arms": arms},
        "amdahl_isolated": median_of([r["amdahl_isolated"] for r in runs]),
        "composition": median_of([r["composition"] for r in runs]),
    }
