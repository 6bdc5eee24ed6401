"""The speculative sampler's per-decode-step trace in a run folder: ``decode_trace.{json,png}`` and
the report's lines (where speculation ran, what it accepted, and why it was off where it was)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...sampler.speculative.trace import off_reason
from .report_format import pyplot, save_figure


def write_trace(run_dir: Path, traces: dict[int, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """``traces``: training step -> :meth:`~grpo_parts.sampler.speculative.trace.DecodeTrace.as_dict` of that step's
    (last) rollout. Writes decode_trace.json and decode_trace.png; returns (files, report lines)."""
    if not traces:
        return [], []
    (run_dir / "decode_trace.json").write_text(json.dumps({str(k): v for k, v in traces.items()}) + "\n")
    files = ["decode_trace.json"]
    step = max(traces)
    t = traces[step]
    if t["k"]:
        _plot(run_dir / "decode_trace.png", traces)
        files.append("decode_trace.png")
    lines = ["## Speculative decoding, per decode step", ""]
    lines += [f"- step {s}: {summary_sentence(traces[s])}" for s in sorted(traces)]
    lines += ["", f"Draft size per decode step (step {step}; a chain of k: depth k, width 1; plain: 0):", ""]
    lines += tree_table(t)
    reason = off_reason(t)
    lines += ["", f"Why speculation was off (step {step}): {reason}." if reason else
              f"Speculation was on at every decode step of step {step}."]  # fmt: skip
    return files, lines


def summary_sentence(t: dict[str, Any]) -> str:
    n = len(t["k"])
    if not n:
        return "no decode steps"
    spec = [i for i, k in enumerate(t["k"]) if k > 0]
    if not spec:
        return f"{n} decode steps, all plain (k = 0)"
    first = spec[0]
    acc = sum(t["tokens"][i] for i in spec) / len(spec)
    mean_k = sum(t["k"][i] for i in spec) / len(spec)
    out = (
        f"{n} decode steps; speculation on in {len(spec)} (from step {first}, at <= {t['active'][first]} active "
        f"rows), mean draft nodes per row {mean_k:.1f}, mean tokens per verification {acc:.2f}"
    )
    width = t.get("width") or []
    trees = [i for i in spec if i < len(width) and width[i] > 1]
    if trees:
        out += (
            f"; draft trees in {len(trees)} steps (nodes {min(t['k'][i] for i in trees)}-"
            f"{max(t['k'][i] for i in trees)}, depth up to {max(t['depth'][i] for i in trees)}, width up to "
            f"{max(width[i] for i in trees)}, {sum(t['tokens'][i] for i in trees) / len(trees):.2f} tokens per verification)"
        )
    tail = [i for i in spec if t["active"][i] <= 16]
    if tail:
        out += f"; in the tail (<= 16 active rows) {sum(t['tokens'][i] for i in tail) / len(tail):.2f} tokens per verification"
    return out


def tree_table(t: dict[str, Any], rows: int = 12) -> list[str]:
    """Per decode step (sampled evenly): active rows, nodes per row, depth, width, tokens emitted per
    verification."""
    n = len(t["k"])
    if not n:
        return []
    idx = sorted({round(i * (n - 1) / max(rows - 1, 1)) for i in range(rows)})
    depth, width = t.get("depth") or [0] * n, t.get("width") or [0] * n
    lines = ["| decode step | active rows | nodes per row | depth | width | tokens per verification |",
             "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    return lines + [
        f"| {i} | {t['active'][i]} | {t['k'][i]} | {depth[i]} | {width[i]} | {t['tokens'][i]:.2f} |"
        for i in idx
    ]


def _plot(path: Path, traces: dict[int, dict[str, Any]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    for s in sorted(traces)[-2:]:
        t = traces[s]
        x = range(len(t["k"]))
        axes[0].plot(x, t["active"], lw=1.2, label=f"step {s}")
        axes[1].step(x, t["k"], where="post", lw=1.2, label=f"step {s} nodes")
        if t.get("depth"):
            axes[2].step(x, t["depth"], where="post", lw=1.0, label=f"step {s} depth")
            axes[2].step(x, t["width"], where="post", lw=1.0, ls="--", label=f"step {s} width")
        axes[3].plot(x, t["tokens"], ".", ms=3, label=f"step {s}")
    axes[0].set(ylabel="active rows", title="speculative rollout, per decode step")
    axes[1].set(ylabel="draft nodes per row\n(0 = plain)")
    axes[2].set(ylabel="tree depth / width")
    axes[3].set(xlabel="decode step", ylabel="tokens per\nverification")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
    save_figure(plt, fig, path)
