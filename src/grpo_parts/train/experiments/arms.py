"""``grpo-parts train --compare --arms ...``: the arms of a comparison, by name, from one table, and
what they are compared on (:func:`arm_summary`; every arm: docs/training.md, "--compare"). When an arm
skips prompts and ``loss.agg`` was left at its default, every arm trains the loss skipping trains
(:data:`~..skip_defaults.SKIP_DEFAULT_AGG`), so the arms differ in their parts only."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from ...errors import GRPOPartsError
from ...skip.history import HistorySkipper
from ..config import REFERENCE_PARTS, TrainConfig
from ..reporting.metrics import summarize
from ..reporting.report_format import fmt, pyplot, save_figure
from ..skip_defaults import STRONG_RULE, TRAIN_HISTORY_KWARGS, skip_default_loss
from .phases import median_of

#: how the ``*_fewer`` arms skip: the step draws its prompts and rolls out only the kept ones
FEWER: dict[str, Any] = {"step_size": "fewer"}
#: how the other skip arms pay: the step keeps its size by drawing more prompts
FILL: dict[str, Any] = {"step_size": "fill"}
#: GRESO's rule as the paper sets it (the skipper's own defaults), pinned so an arm keeps its meaning
#: whatever this door's default settings are
GRESO: dict[str, Any] = {k: HistorySkipper.model_fields[k].default for k in STRONG_RULE}


def _max_weight(w: float) -> dict[str, Any]:
    """A floor on every prompt's inclusion probability, so a kept prompt weighs at most ``w`` (``1 / p``):
    less variance in the step's gradient, fewer skips."""
    return {"min_keep_prob": 1.0 / w}


def _skip(filter_name: str, *settings: dict[str, Any]) -> dict[str, Any]:
    """A skip arm: ``filter_name`` behind ``history`` with ``settings`` merged over the skipper's own
    defaults of every setting this door's default changes, so no arm inherits them (a weighted
    filter never refills: its weights are for the drawn batch)."""
    kwargs: dict[str, Any] = {k: HistorySkipper.model_fields[k].default for k in TRAIN_HISTORY_KWARGS}
    for s in settings:
        kwargs.update(s)
    arm: dict[str, Any] = {"filter": filter_name, "prompt_skip": "history", "prompt_skip_kwargs": kwargs}
    if filter_name == "dppo":
        arm["refill_rounds"] = 0
    return arm


#: arm -> the ``parts`` settings it overrides (None: the configured parts as given)
ARMS: dict[str, dict[str, Any] | None] = {
    "reference": {**REFERENCE_PARTS, "refill_rounds": 0},
    "optimized": None,
    "keep_all": {"filter": "keep_all", "prompt_skip": "none"},
    "cppo": {"filter": "cppo", "prompt_skip": "none"},
    "dppo": {"filter": "dppo", "refill_rounds": 0, "prompt_skip": "none"},
    "cppo+skip": _skip("cppo", GRESO, FILL),
    "dppo+skip": _skip("dppo", GRESO, FILL),
    "cppo+skip_fewer": _skip("cppo", GRESO, FEWER),
    "dppo+skip_fewer": _skip("dppo", GRESO, FEWER),
    "keep_all+skip_fewer": _skip("keep_all", GRESO, FEWER),
    # a lower exploration base that adapts faster towards a lower zero-variance share
    "cppo+skip_strong": _skip("cppo", STRONG_RULE, FILL),
    "cppo+skip_strong_fewer": _skip("cppo", STRONG_RULE, FEWER),
    # a kept prompt weighing at most 2 or 3 (docs/results.md, "Five seeds, and bounded weights")
    "cppo+skip_strong_fewer_w2": _skip("cppo", STRONG_RULE, FEWER, _max_weight(2.0)),
    "cppo+skip_strong_fewer_w3": _skip("cppo", STRONG_RULE, FEWER, _max_weight(3.0)),
    "cppo+skip_strong_fewer_f50": _skip("cppo", STRONG_RULE, FEWER, {"min_rollout_share": 0.5}),
    "cppo+skip_posterior": _skip("cppo", GRESO, FILL, {"rule": "posterior"}),
    # the paired arms that decide this door's finite-data default (docs/results.md): the configured
    # run with prompt skipping on or off, and every other setting -- the loss included -- as a user
    # who says only that gets it (AS_USERS_RUN)
    "skip_on": {"prompt_skip": "history"},
    "skip_off": {"prompt_skip": "none"},
}
#: arms that keep the loss a user who runs them alone would train, instead of one loss for every arm
AS_USERS_RUN = ("skip_on", "skip_off")
DEFAULT_ARMS = ("reference", "optimized")


def arm_configs(config: TrainConfig, arms: list[str] | tuple[str, ...]) -> dict[str, TrainConfig]:
    """One validated config per arm (an unknown arm, or one the loss cannot serve, is refused here,
    before any run folder exists)."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise GRPOPartsError(f"--arms: expected names from {list(ARMS)}, got {list(arms)}")
    base = config.model_dump(mode="json", exclude_unset=True)
    skipping = any((ARMS[a] or {}).get("prompt_skip") == "history" for a in arms if a not in AS_USERS_RUN)
    if skipping and "agg" not in config.loss.model_fields_set:  # one loss for every arm
        base["loss"] = skip_default_loss(base.get("loss", {}), config.max_new_tokens)
    out = {}
    for arm in arms:
        data = dict(base) if arm not in AS_USERS_RUN else _as_user_runs(config, arm)
        own = ARMS[arm]
        if own is not None:
            given = dict(base.get("parts", {}))
            parts = {**given, **own}
            if "prompt_skip_kwargs" in own:  # the arm's skip settings on top of the configured ones
                parts["prompt_skip_kwargs"] = {
                    **given.get("prompt_skip_kwargs", {}),
                    **own["prompt_skip_kwargs"],
                }
            if parts.get("prompt_skip") == "none":  # the configured skip settings belong to skipping arms
                parts.pop("prompt_skip_kwargs", None)
            data["parts"] = parts
        out[arm] = TrainConfig.model_validate(data)
    return out


def _as_user_runs(config: TrainConfig, arm: str) -> dict[str, Any]:
    """``config``'s fields as given, for an :data:`AS_USERS_RUN` arm. ``skip_off`` drops skipping's
    default loss (a config validated with ``parts.prompt_skip=history`` carries it, given or filled
    in), so it trains what ``parts.prompt_skip=none`` trains when ``loss.agg`` is not given."""
    data = config.model_dump(mode="json", exclude_unset=True)
    loss = dict(data.get("loss", {}))
    if arm == "skip_off" and loss == {**loss, **skip_default_loss({}, config.max_new_tokens)}:
        loss.pop("agg"), loss.pop("norm_constant")
        data["loss"] = loss
    return data


def _tokens_until(rows: list[dict[str, Any]], step: int | None) -> float | None:
    if step is None:
        return None
    return float(sum(r.get("rollout_tokens", 0) for r in rows if 0 < r.get("step", 0) <= step))


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get("step", 0) > 0 and r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def arm_summary(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The run's :func:`~.metrics.summarize` plus what the filter arms are compared on."""
    out = summarize(rows, target)
    steps = [r for r in rows if r.get("step", 0) > 0]
    drawn = sum(float(r.get("prompts_drawn", r.get("prompts", 0))) for r in steps)
    skipped = sum(float(r.get("prompts_skipped", 0)) for r in steps)
    out.update(
        rollout_tokens=float(sum(r.get("rollout_tokens", 0) for r in steps)),
        rollout_tokens_to_target=_tokens_until(rows, out["steps_to_target"]),
        rollout_tokens_per_step=_mean(rows, "rollout_tokens"),
        zero_variance_share=_mean(rows, "zero_variance_share"),
        prompts_skipped_share=skipped / drawn if drawn else 0.0,
    )
    return out


#: per-arm fields the report's table shows (JSON keys: a contract)
TABLE = (
    ("time_to_target_s", "time to target (s)", ".1f"),
    ("steps_to_target", "steps to target", ".0f"),
    ("rollout_tokens_to_target", "rollout tokens to target", ".0f"),
    ("rollout_tokens", "rollout tokens (run)", ".0f"),
    ("rollout_tokens_per_step", "rollout tokens / step", ".0f"),
    ("zero_variance_share", "zero-variance groups", ".2f"),
    ("prompts_skipped_share", "prompts skipped", ".2f"),
    ("mean_step_s", "s / step", ".2f"),
    ("final_accuracy", "final accuracy", ".3f"),
    ("seeds_reached", "seeds reaching the target", ".0f"),
)
#: the fields a seed that never reached the target has no value for: its value is +inf in the median
TO_TARGET = ("time_to_target_s", "steps_to_target", "rollout_tokens_to_target")


def arms_markdown(result: dict[str, Any]) -> list[str]:
    arms = list(result["arms"])
    lines = [
        f"# Arms compared (target held-out accuracy {result['target_accuracy']:.2f}"
        + (f", medians over seeds {result['seeds']})" if "seeds" in result else ")"),
        "",
        "| | " + " | ".join(arms) + " |",
        "|---|" + "---:|" * len(arms),
    ]
    for key, label, spec in TABLE:
        lines.append(f"| {label} | " + " | ".join(fmt(result["arms"][a].get(key), spec) for a in arms) + " |")
    return lines


def plot_arms(runs: dict[str, list[dict[str, Any]]], target: float, path: Any) -> None:
    """Held-out accuracy against training wall time and against rollout tokens, one line per arm."""
    plt = pyplot()
    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, rows in runs.items():
        tokens, points = 0.0, []
        for r in rows:
            tokens += float(r.get("rollout_tokens", 0)) if r.get("step", 0) > 0 else 0.0
            if r.get("eval_accuracy") is not None:
                points.append((float(r.get("wall_time", 0.0)), tokens, float(r["eval_accuracy"])))
        by_time.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=arm)
        by_tokens.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=arm)
    for ax, xlabel in ((by_time, "training wall time (s)"), (by_tokens, "rollout tokens")):
        ax.axhline(target, color="grey", linestyle=":")
        ax.set(xlabel=xlabel, ylabel="held-out accuracy")
    by_time.legend(fontsize=7)
    save_figure(plt, fig, path)


def write_arms(
    out_dir: Any, runs: dict[str, list[dict[str, Any]]], target: float, info: dict[str, Any]
) -> dict[str, Any]:
    result = {"target_accuracy": target, **info, "arms": {a: arm_summary(r, target) for a, r in runs.items()}}
    (out_dir / "arms.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "arms.md").write_text("\n".join(arms_markdown(result)) + "\n")
    plot_arms(runs, target, out_dir / "arms.png")
    return result


def _median_to_target(vals: list[Any]) -> float | None:
    """The median with "not reached" (None) as +inf: an arm that misses the target in most seeds has
    no median (None), and one missed seed moves the median up, never down."""
    m = statistics.median([math.inf if v is None else float(v) for v in vals])
    return None if math.isinf(m) else m


def aggregate_arms(per_seed: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per arm, the median over seeds of every numeric field (None where a seed has none; for the to-target
    fields, a seed that never reached the target counts as +inf) and how many seeds reached the target."""
    arms = list(per_seed[0]["arms"])
    keys = [k for k, _, _ in TABLE if k != "seeds_reached"]
    med: dict[str, dict[str, Any]] = {}
    for a in arms:
        vals = {k: [r["arms"][a].get(k) for r in per_seed] for k in keys}
        med[a] = {k: (_median_to_target if k in TO_TARGET else median_of)(v) for k, v in vals.items()}
        med[a]["seeds_reached"] = float(sum(v is not None for v in vals["steps_to_target"]))
    return {
        "target_accuracy": per_seed[0]["target_accuracy"],
        "seeds": seeds,
        "arms": med,
        "per_seed": per_seed,
    }
