"""``report.md`` and PNG plots of a run, and the side-by-side report of ``--compare``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...filter.protocol import KEPT_FRACTION
from ...sampler.stats import ACCEPTED_PER_VERIFY
from ..experiments.ablation import ablation_lines, isolated_bound
from ..experiments.phases import phase_breakdown
from .metrics import accuracy_goal_met, eval_curve, summarize
from .report_format import fmt, pyplot, save_figure
from .trace_report import write_trace

WALL_TIME = "training wall time (s)"


def plot_run(rows: list[dict[str, Any]], out_dir: Path, title: str = "") -> list[str]:
    """accuracy.png (train-batch and held-out accuracy vs step and vs wall time), step_time.png (the
    step's phases, stacked) and acceptance.png (tokens per verification); returns file names."""
    plt = pyplot()
    steps = [r for r in rows if "time_step" in r]
    return [
        _plot_accuracy(plt, rows, steps, out_dir, title),
        _plot_step_time(plt, steps, out_dir),
        _plot_acceptance(plt, steps, out_dir),
    ]


def _plot_accuracy(
    plt: Any, rows: list[dict[str, Any]], steps: list[dict[str, Any]], out_dir: Path, title: str
) -> str:
    curve = eval_curve(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    if steps:
        x, y = [r["step"] for r in steps], [r["accuracy"] for r in steps]
        axes[0].plot(x, y, color="0.75", lw=1, label="train batch (sampled)")
    axes[0].plot([c[0] for c in curve], [c[2] for c in curve], "o-", label="held-out")
    axes[0].set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title="accuracy vs step")
    axes[1].plot([c[1] for c in curve], [c[2] for c in curve], "o-")
    axes[1].set(xlabel=WALL_TIME, ylabel="held-out accuracy", ylim=(0, 1), title="accuracy vs wall time")
    axes[0].legend(loc="lower right")
    fig.suptitle(title)
    return save_figure(plt, fig, out_dir / "accuracy.png")


def _plot_step_time(plt: Any, steps: list[dict[str, Any]], out_dir: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = [r["step"] for r in steps]
    parts = [("time_rollout", "rollout"), ("time_training", "training"), ("time_other", "other")]
    ax.stackplot(x, *[[r.get(k) or 0.0 for r in steps] for k, _ in parts], labels=[n for _, n in parts])
    ax.set(xlabel="step", ylabel="seconds", title="step time breakdown")
    ax.legend(loc="upper right")
    return save_figure(plt, fig, out_dir / "step_time.png")


def _plot_acceptance(plt: Any, steps: list[dict[str, Any]], out_dir: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    acc = [(r["step"], r[ACCEPTED_PER_VERIFY]) for r in steps if r.get(ACCEPTED_PER_VERIFY) is not None]
    if acc:
        ax.plot([a[0] for a in acc], [a[1] for a in acc], "o-", ms=3)
        ax.set(xlabel="step", ylabel="tokens per verification", title="speculative acceptance length")
    else:
        text = "no speculative sampler in this run\n(1 token per policy forward)"
        ax.text(0.5, 0.5, text, ha="center", va="center")
        ax.set(title="speculative acceptance length", xticks=[], yticks=[])
    return save_figure(plt, fig, out_dir / "acceptance.png")


def write_report(
    run_dir: Path, rows: list[dict[str, Any]], info: dict[str, Any], target: float
) -> dict[str, Any]:
    """Plots + report.md; returns the summary dict (also written to summary.json)."""
    s = summarize(rows, target)
    files = plot_run(rows, run_dir, info.get("title", run_dir.name))
    trace_files, trace_lines = write_trace(run_dir, info.get("traces") or {})
    shared, lean = s.get("decode_attention_shared_fraction"), s.get("lean_forward_fraction")
    speculative: list[str] = []
    if shared is not None:
        speculative += [
            f"Decode attention: {shared:.0%} of the speculative decode loop's attention calls read each "
            "group's prompt once (the rest: the policy's own attention).",
            "",
        ]
    if lean is not None:
        speculative += [
            f"Lean decode forward: {lean:.0%} of the speculative decode loop's forwards called the policy's "
            "weights directly (the rest: the model's own forward; the log says why).",
            "",
        ]
    lines = [
        f"# GRPO run `{run_dir.name}`",
        "",
        f"Status: **{info.get('status', 'completed')}** · parts: {info.get('parts', '-')}",
        "",
        *[f"- {n}" for n in info.get("notes", [])],
        "",
        "| held-out accuracy: start | final (mean of last 3 evals) | last | best | steps | training wall time (s) | mean step (s) |",
        "|---|---|---|---|---|---|---|",
        f"| {fmt(s['initial_accuracy'])} | {fmt(s['final_accuracy'])} | {fmt(s['last_accuracy'])} | {fmt(s['best_accuracy'])} | {s['steps']} "
        f"| {fmt(s['wall_time_s'], '.1f')} | {fmt(s['mean_step_s'])} |",
        "",
        f"Time to {target:.0%} held-out accuracy: {fmt(s['time_to_target_s'], '.1f')} s of training "
        f"(interpolated between evaluations; first evaluation above it: step {fmt(s['steps_to_target'])}).",
        "",
        "| mean rollout (s) | training (s) | other (s) | tokens/s | accepted per verify | kept fraction |",
        "|---|---|---|---|---|---|",
        f"| {fmt(s['mean_rollout_s'])} | {fmt(s['mean_training_s'])} | {fmt(s['mean_other_s'])} "
        f"| {fmt(s['tokens_per_s'], '.0f')} | {fmt(s[ACCEPTED_PER_VERIFY], '.2f')} | {fmt(s[KEPT_FRACTION], '.2f')} |",
        "",
        *speculative,
        *[f"![{f}]({f})" for f in files],
        "",
        *trace_lines,
        *[f"![{f}]({f})" for f in trace_files if f.endswith(".png")],
        "",
        *sample_lines(info.get("samples") or []),
        "Held-out accuracy is greedy by default and is timed apart from training (wall time excludes it).",
        "Per-step rows: `metrics.jsonl`; completions at each evaluation: `samples.jsonl`; config: `config.yaml`.",
    ]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    return s


def sample_lines(samples: list[dict[str, Any]]) -> list[str]:
    """A few held-out completions of the last evaluation, with their answers and rewards."""
    if not samples:
        return []
    lines = [f"Held-out completions at step {samples[0]['step']} (more in `samples.jsonl`):", ""]
    for r in samples:
        lines += [
            f"- reward {r['reward']:g}, answer `{r['answer']}`, prompt ...`{r['prompt'][-60:]}`",
            f"  completion `{r['completion'][-200:]}`",
        ]
    return [*lines, ""]


def write_compare(
    out_dir: Path, runs: dict[str, list[dict[str, Any]]], target: float, info: dict[str, Any]
) -> dict[str, Any]:
    """compare.json, compare.md and compare.png for ``{"reference": rows, "optimized": rows}``."""
    sums = {k: summarize(v, target) for k, v in runs.items()}
    result = compare_result(sums, target, info)
    (out_dir / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot_compare(runs, target, info, out_dir)
    (out_dir / "compare.md").write_text("\n".join(compare_lines(result)) + "\n")
    return result


def compare_result(sums: dict[str, dict[str, Any]], target: float, info: dict[str, Any]) -> dict[str, Any]:
    """compare.json: speedups, accuracy difference, phase breakdown (and ablation) from the arms'
    summaries (``reference``, ``optimized``, any ``only_*``), with ``info`` and the summaries (None
    where a side has no value)."""
    ref, opt = sums["reference"], sums["optimized"]
    speedup = None
    if ref["time_to_target_s"] and opt["time_to_target_s"]:
        speedup = ref["time_to_target_s"] / opt["time_to_target_s"]
    diff = None
    if ref["final_accuracy"] is not None and opt["final_accuracy"] is not None:
        diff = opt["final_accuracy"] - ref["final_accuracy"]
    step_speedup = ref["mean_step_s"] / opt["mean_step_s"] if opt["mean_step_s"] else None
    return {
        "target_accuracy": target,
        "speedup_to_target": speedup,
        "step_speedup": step_speedup,
        "accuracy_diff": diff,
        **phase_breakdown(ref, opt),
        **(isolated_bound(sums, step_speedup) if len(sums) > 2 else {}),
        "mean_step_speedup": step_speedup,
        "final_accuracy_diff": diff,
        "passes": bool(speedup is not None and speedup >= 3.0 and accuracy_goal_met(diff)),
        **info,
        "runs": sums,
    }


def _plot_compare(
    runs: dict[str, list[dict[str, Any]]], target: float, info: dict[str, Any], out_dir: Path
) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        c, label = eval_curve(rows), f"{name} ({info.get('parts', {}).get(name, '')})"
        ax.plot([x[1] for x in c], [x[2] for x in c], "o-", ms=3, label=label)
    ax.axhline(target, color="0.5", ls="--", lw=1, label=f"target {target:.0%}")
    ax.set(xlabel=WALL_TIME, ylabel="held-out accuracy", ylim=(0, 1), title="reference vs optimized parts")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(plt, fig, out_dir / "compare.png")


def compare_lines(result: dict[str, Any]) -> list[str]:
    """compare.md: the arms' table, the speedup and accuracy verdict, phases and ablation."""
    target = result["target_accuracy"]
    lines = [
        "# Reference vs optimized parts (same seed, same data)",
        "",
        *[f"- {k}: {v}" for k, v in result.get("parts", {}).items()],
        "",
        f"| parts | start acc | final acc | time to {target:.0%} (s) | steps to target | mean step (s) | rollout (s) | training (s) | accepted/verify | kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["runs"].items():
        lines.append(
            f"| {name} | {fmt(s['initial_accuracy'])} | {fmt(s['final_accuracy'])} | {fmt(s['time_to_target_s'], '.1f')} "
            f"| {fmt(s['steps_to_target'])} | {fmt(s['mean_step_s'])} | {fmt(s['mean_rollout_s'])} "
            f"| {fmt(s['mean_training_s'])} | {fmt(s[ACCEPTED_PER_VERIFY], '.2f')} | {fmt(s[KEPT_FRACTION], '.2f')} |"
        )
    speedup, step_speedup, diff = result["speedup_to_target"], result["step_speedup"], result["accuracy_diff"]
    return [
        *lines,
        "",
        "Time to target: training wall time (evaluation excluded), interpolated between evaluations. "
        "Final accuracy: mean of the last 3 evaluations.",
        "",
        f"Speedup to target (reference time / optimized time): **{fmt(speedup, '.2f')}x**; "
        f"mean step speedup {fmt(step_speedup, '.2f')}x; final accuracy difference (optimized - reference): "
        f"{fmt(diff, '+.3f')}. Goal: >= 3x and within 3 points or better -> {'met' if result['passes'] else 'not met'}.",
        "",
        *phase_lines(result),
        "",
        *ablation_lines(result),
        "![compare](compare.png)",
    ]


def phase_lines(result: dict[str, Any]) -> list[str]:
    """The per-phase table of a comparison (seconds per step, ratio, share of the reference step)."""
    lines = [
        "| phase | reference (s/step) | optimized (s/step) | ratio | share of reference step |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, p in result["phases"].items():
        lines.append(
            f"| {name} | {fmt(p['reference_s'])} | {fmt(p['optimized_s'])} | {fmt(p['ratio'], '.2f')}x "
            f"| {fmt(p['share'], '.0%')} |"
        )
    return [
        *lines,
        "",
        f"Amdahl bound from the phase ratios (other unchanged): {fmt(result['amdahl_bound'], '.2f')}x; "
        f"measured step speedup {fmt(result['step_speedup'], '.2f')}x; rollout share of the reference step "
        f"{fmt(result['rollout_share'], '.0%')}.",
    ]
