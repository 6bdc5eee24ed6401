"""Per-step metrics as JSONL, and summaries of a run (time to a target accuracy, final accuracy)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ...filter.protocol import KEPT_FRACTION
from ...sampler.stats import (
    ACCEPTED_PER_VERIFY,
    DECODE_ATTENTION_PLAIN_CALLS,
    DECODE_ATTENTION_SHARED_PREFIX_CALLS,
    LEAN_FORWARD_CALLS,
    MODEL_FORWARD_CALLS,
)
from ..lifecycle.checkpoint import atomic_write_text


class MetricsWriter:
    """Appends one JSON object per line; flushed every write so a crashed run keeps its history."""

    def __init__(self, path: Path, keep_up_to_step: int | None = None):
        self.path = path
        if keep_up_to_step is not None and path.exists():  # resume: drop rows after the checkpoint
            rows = [r for r in read_metrics(path) if int(r.get("step", 0)) <= keep_up_to_step]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))  # a kill keeps the old rows
        self._fh = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._fh.write(json.dumps(clean) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_curve(rows: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """``(step, wall_time, eval_accuracy)`` for every row that has a held-out evaluation."""
    return [
        (int(r["step"]), float(r.get("wall_time", 0.0)), float(r["eval_accuracy"]))
        for r in rows
        if r.get("eval_accuracy") is not None
    ]


def time_to_target(rows: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """``(step, wall_time)`` when held-out accuracy first reaches ``target``: the step is the first evaluation
    at or above it; the time is interpolated linearly between that evaluation and the one before (evaluations
    are every few steps, so this removes most of the quantisation). ``(None, None)`` if never reached."""
    curve = eval_curve(rows)
    for i, (step, wall, acc) in enumerate(curve):
        if acc >= target:
            if i == 0:
                return step, wall
            _, w0, a0 = curve[i - 1]
            return step, w0 + (wall - w0) * (target - a0) / (acc - a0)
    return None, None


#: how many evaluations (after step 0) the final accuracy averages: one evaluation of 200 problems is +-3 points
FINAL_EVALS = 3


def final_accuracy(rows: list[dict[str, Any]], last: int = FINAL_EVALS) -> float | None:
    """Mean held-out accuracy of the last ``last`` evaluations (less noisy than the last one alone)."""
    accs = [c[2] for c in eval_curve(rows)][1:][-last:]
    return sum(accs) / len(accs) if accs else None


#: the accuracy goal of ``--compare``: the optimized arm's final accuracy within this of the reference's,
#: or better (an optimized arm that learns more is no failure)
ACCURACY_TOLERANCE = 0.03


def accuracy_goal_met(diff: float | None) -> bool:
    return diff is not None and diff >= -ACCURACY_TOLERANCE


def summarize(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    curve = eval_curve(rows)
    steps = [r for r in rows if r.get("step", 0) > 0 and "time_step" in r]
    n = max(1, len(steps))

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in steps if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    t_step, t_wall = time_to_target(rows, target)
    return {
        "initial_accuracy": curve[0][2] if curve else None,
        "final_accuracy": final_accuracy(rows),
        "final_evals": min(FINAL_EVALS, max(0, len(curve) - 1)),  # the evaluations final_accuracy averages
        "last_accuracy": curve[-1][2] if curve else None,
        "best_accuracy": max(c[2] for c in curve) if curve else None,
        "target_accuracy": target,
        "steps_to_target": t_step,
        "time_to_target_s": t_wall,
        "steps": len(steps),
        "wall_time_s": float(steps[-1]["wall_time"]) if steps else 0.0,
        "mean_step_s": sum(float(r["time_step"]) for r in steps) / n,
        "mean_rollout_s": mean("time_rollout"),
        "mean_training_s": mean("time_training"),
        "mean_other_s": mean("time_other"),
        "mean_logprobs_s": mean("time_logprobs"),
        "mean_update_s": mean("time_update"),
        "mean_draft_s": mean("time_draft"),
        "tokens_per_s": mean("tokens_per_s"),
        ACCEPTED_PER_VERIFY: mean(ACCEPTED_PER_VERIFY),
        KEPT_FRACTION: mean(KEPT_FRACTION),
        "decode_attention_shared_fraction": _fraction(
            steps, DECODE_ATTENTION_SHARED_PREFIX_CALLS, DECODE_ATTENTION_PLAIN_CALLS
        ),
        "lean_forward_fraction": _fraction(steps, LEAN_FORWARD_CALLS, MODEL_FORWARD_CALLS),
        "train_reward_last10": (
            sum(float(r["reward"]) for r in steps[-10:]) / len(steps[-10:]) if steps else None
        ),
    }


def _fraction(steps: list[dict[str, Any]], part: str, rest: str) -> float | None:
    """``part / (part + rest)`` summed over the steps (None: no step counted either)."""
    a = sum(float(r.get(part) or 0.0) for r in steps)
    b = sum(float(r.get(rest) or 0.0) for r in steps)
    return a / (a + b) if a + b else None
