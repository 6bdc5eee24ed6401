"""Per-phase breakdown of reference vs optimized steps, and the step speedup Amdahl's law predicts:
``amdahl_bound = t_ref / (sum_i t_opt_i + other_ref)``, which the measured step speedup falls below by
exactly what the optimized arm adds to ``other`` (tokenising, rewards, advantages, filter)."""

from __future__ import annotations

import statistics
from typing import Any

#: phase -> the summary key of its mean seconds per step
PHASES = {
    "rollout": "mean_rollout_s",
    "logprobs": "mean_logprobs_s",
    "update": "mean_update_s",
    "draft": "mean_draft_s",
}


def median_of(vals: list[Any]) -> float | None:
    """The median of the values that are not None (None when there are none): seeds may lack a value."""
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def mean_of(vals: list[Any]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def _phase(r: float, o: float, t_ref: float) -> dict[str, float | None]:
    return {
        "reference_s": r,
        "optimized_s": o,
        "ratio": r / o if o > 0 else None,
        "share": r / t_ref if t_ref > 0 else None,
    }


def phase_breakdown(ref: dict[str, Any], opt: dict[str, Any]) -> dict[str, Any]:
    """``phases`` (per phase: reference and optimized seconds per step, ratio = ref / opt, share of
    the reference step), ``rollout_share`` and ``amdahl_bound`` from two run summaries."""
    t_ref, t_opt = float(ref["mean_step_s"] or 0.0), float(opt["mean_step_s"] or 0.0)
    phases: dict[str, dict[str, float | None]] = {}
    named_ref = named_opt = 0.0
    for name, key in PHASES.items():
        r, o = float(ref.get(key) or 0.0), float(opt.get(key) or 0.0)
        named_ref, named_opt = named_ref + r, named_opt + o
        phases[name] = _phase(r, o, t_ref)
    o_ref = max(t_ref - named_ref, 0.0)
    phases["other"] = _phase(o_ref, max(t_opt - named_opt, 0.0), t_ref)
    predicted = named_opt + o_ref
    return {
        "phases": phases,
        "rollout_share": phases["rollout"]["share"],
        "amdahl_bound": t_ref / predicted if predicted > 0 else None,
    }


def median_phases(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    names = per_seed[0]["phases"].keys() if per_seed else []
    fields = ("reference_s", "optimized_s", "ratio", "share")
    return {n: {f: median_of([r["phases"][n][f] for r in per_seed]) for f in fields} for n in names}
