"""A TRL user's comparison: TRL's stock ``GRPOTrainer`` against ``GRPOPartsTrainer`` with every part
on (speculative sampler + n-gram draft, shared-prefix attention, CPPO at the builder's default rate),
same model, data, reward and TRL configuration, on the built-in reasoning task.

Workload (flags change it): the committed ``tiny_reasoner`` warm start (what ``grpo-parts train``
loads), 16 prompts x 8 completions per optimizer step, ``max_completion_length=320`` (the main
job's), learning rate 1e-4 (the main job's), TRL 1.16's defaults otherwise (bf16 autocast, gradient
checkpointing, ``loss_type`` and ``beta`` as TRL sets them), reward = the task's grader (1 for the
right number after the last ``;``). Each (arm, seed) runs in its own process, the arms alternating,
so neither inherits the other's warm caches or allocator.

Reported per arm and seed: wall seconds per optimizer step (TRL's callback, step begin to end:
rollout, rewards, log-probs, update), mean reward per step, mean completion length, and for the
parts arm the counters that prove the optimized paths ran. ``step_speedup`` is the mean over seeds
of (stock mean step time / parts mean step time); the first step is reported but excluded from that
mean (``--skip-first``, default 1: warm-up). ``--json`` keys: ``workload``, ``machine``, ``date``,
``arms.<arm>.seeds.<seed>.{step_s, reward, completion_length, counters}``, ``step_s_mean``,
``step_speedup``, ``step_speedup_per_seed``. ``--png`` plots reward against step and wall time.

    python scripts/measure/trl_vs_stock.py --steps 6 --seeds 0 1 --json /tmp/trl.json --png /tmp/trl.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("stock", "parts")
#: the parts arm's counters (TRL's logged metrics) summed over the steps: each must be > 0
PARTS_COUNTERS = (
    "parts/sampler/lean_forward_calls",
    "parts/sampler/decode_attention_shared_prefix_calls",
    "parts/sampler/verify_steps",
    "parts/attention/forwards",
    "parts/filter/calls",
)
REFUSALS = ("parts/sampler/lean_forward_refused", "parts/sampler/decode_attention_refused")


def reward_fn(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """The reasoning task's grader in TRL's reward-function signature."""
    from grpo_parts.task.graders import after_delimiter

    return [1.0 if after_delimiter(c, ";") == a else 0.0 for c, a in zip(completions, answer)]


def _trainer(arm: str, seed: int, args: argparse.Namespace, out_dir: str) -> Any:
    import torch
    from datasets import Dataset
    from grpo_parts_adapters.trl import GRPOPartsTrainer
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    from grpo_parts.task.reasoning import ReasoningTask
    from grpo_parts.train.lifecycle.setup import builtin_model_path, load_model

    set_seed(seed)
    model, tok = load_model(
        builtin_model_path("reasoning"), torch.float32, torch.device("cpu"), progress=False
    )
    task = ReasoningTask(seed=seed)
    problems = [task.train_problem(i) for i in range(args.prompts * (args.steps + 1))]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to="none", seed=seed, max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.max_completion_length, learning_rate=args.lr,
        logging_steps=1, disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    common = dict(model=model, reward_funcs=reward_fn, args=config, processing_class=tok, train_dataset=data)
    if arm == "stock":
        return GRPOTrainer(**common)
    return GRPOPartsTrainer(
        **common, sampler="speculative", draft="ngram", attention="shared_prefix", filter="cppo"
    )


def run_child(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One arm, one seed, in this process: what the parent aggregates."""
    from transformers import TrainerCallback

    starts: list[float] = []
    step_s: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            starts.append(time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_s.append(time.perf_counter() - starts[-1])
            print(f"[{arm} seed {seed}] step {len(step_s)}: {step_s[-1]:.1f}s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _trainer(arm, seed, args, out_dir)
        trainer.add_callback(Clock())
        trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    counters = {k: sum(float(h.get(k, 0.0)) for h in logs) for k in PARTS_COUNTERS + REFUSALS}
    return {
        "step_s": step_s,
        "reward": [float(h["reward"]) for h in logs],
        "completion_length": [float(h.get("completions/mean_length", float("nan"))) for h in logs],
        "counters": counters if arm == "parts" else {},
    }


def _spawn(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", arm, "--child-seed", str(seed), "--child-out", f.name]
        cmd += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group)]
        cmd += ["--max-completion-length", str(args.max_completion_length), "--lr", str(args.lr)]
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())  # type: ignore[no-any-return]


def summarize(results: dict[str, dict[int, dict[str, Any]]], skip_first: int) -> dict[str, Any]:
    """Mean step time per arm (after ``skip_first`` steps) and the stock/parts ratio per seed."""
    means = {
        arm: {s: statistics.fmean(r["step_s"][skip_first:] or r["step_s"]) for s, r in seeds.items()}
        for arm, seeds in results.items()
    }
    out: dict[str, Any] = {"step_s_mean": {a: statistics.fmean(m.values()) for a, m in means.items()}}
    if set(ARMS) <= set(means):
        per_seed = {s: means["stock"][s] / means["parts"][s] for s in means["parts"] if s in means["stock"]}
        out["step_speedup_per_seed"] = per_seed
        out["step_speedup"] = statistics.fmean(per_seed.values()) if per_seed else None
    return out


def plot(results: dict[str, dict[int, dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, seeds in results.items():
        for seed, r in seeds.items():
            steps = range(1, len(r["reward"]) + 1)
            wall = [sum(r["step_s"][: i + 1]) for i in range(len(r["reward"]))]
            by_step.plot(steps, r["reward"], marker="o", label=f"{arm} seed {seed}")
            by_time.plot(wall, r["reward"], marker="o", label=f"{arm} seed {seed}")
    by_step.set(xlabel="optimizer step", ylabel="mean reward", title="reward per step")
    by_time.set(xlabel="wall seconds", ylabel="mean reward", title="reward against wall time")
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which trainers to run")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="one run per arm per seed")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--max-completion-length", type=int, default=320, help="TRL's max_completion_length")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (the main job's)")
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps left out of the mean step time")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="plot reward against step and wall time here")
    p.add_argument("--child", choices=ARMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(run_child(args.child, args.child_seed, args)))
        return 0
    results: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:  # alternating: drift of the machine falls on both arms
            results[arm][seed] = _spawn(arm, seed, args)
    summary = summarize(results, args.skip_first)
    report = {
        "workload": {
            k: getattr(args, k) for k in ("steps", "prompts", "group", "max_completion_length", "lr")
        },
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "arms": {arm: {"seeds": seeds} for arm, seeds in results.items()},
        **summary,
    }
    for arm, seeds in results.items():
        for seed, r in seeds.items():
            steps = " ".join(f"{t:.1f}" for t in r["step_s"])
            rewards = " ".join(f"{x:.3f}" for x in r["reward"])
            print(f"{arm:>5} seed {seed}: step s [{steps}]  reward [{rewards}]")
    print(f"mean step s: {summary['step_s_mean']}; step speedup: {summary.get('step_speedup')}")
    if "parts" in results:
        bad = {k: v for s in results["parts"].values() for k, v in s["counters"].items()
               if (k in PARTS_COUNTERS and not v > 0) or (k in REFUSALS and v)}  # fmt: skip
        if bad:
            print(f"the parts arm did not run every optimization: {bad}", file=sys.stderr)
            return 1
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
