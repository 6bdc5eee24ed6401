"""A verl user's comparison: verl 0.9.1's own trainer (``python -m verl.trainer.main_ppo``, the default
v1 sync trainer) with grpo_parts' reference parts against every optimized part, same rollout backend
(``actor_rollout_ref.rollout.name=grpo_parts``), same data, model and verl configuration.

* ``reference``: the reference sampler (plain batched KV-cache sampling), verl's own packed forward
  for old/ref log-probs and the update, no filter;
* ``parts``: the speculative sampler with the n-gram draft (lean decode forward, online sizing),
  shared-prefix log-probs in verl's FSDP engines (engine hook), CPPO keeping k = half the rows
  (``ppo_mini_batch_size`` = half the prompts in both arms, so the kept half is one whole mini-batch).

Workload (flags change it): the committed ``tiny_reasoner`` (what ``grpo-parts train`` loads), the
built-in reasoning task, 16 prompts x 8 completions per step, 320 new tokens at most, learning rate
1e-4, reward = the task's grader. verl runs on this CPU through the tests' CPU platform plugin
(tests/adapters/verl/verl_cpu_plugin.py: verl 0.9.1 registers no CPU platform); each (arm, seed)
is its own ``main_ppo`` process, the arms alternating. Reported per step from verl's own metrics:
``timing_s/step`` (and gen / old_log_prob / update_actor), the mean score of every rolled-out row
(``parts/filter/score_mean_rolled_out`` in the parts arm: verl's ``critic/score/mean`` and
``response_length/mean`` are over the rows trained, CPPO's kept half there), the mean response
length of the rows trained. ``step_speedup`` is the mean over seeds of reference / parts mean step time, the first step
left out (``--skip-first``: Ray and FSDP warm-up).

    python scripts/measure/verl_trainer_bench.py --steps 6 --seeds 0 1 --json /tmp/verl.json --png /tmp/verl.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "adapters" / "verl"))  # verl_e2e, verl_cpu_plugin, _cpu_verl

ARMS = ("reference", "parts")
REWARD_FN = """
from grpo_parts.task.graders import after_delimiter


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if after_delimiter(solution_str, ";") == str(ground_truth) else 0.0
"""
SAMPLER_PREFIX = "parts/sampler/"
ROLLED_OUT_SCORE = "parts/filter/score_mean_rolled_out"
KEYS = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor")


def reasoning_assets(workdir: Path, n_prompts: int, seed: int) -> dict[str, Path]:
    """tiny_reasoner with a chat template that passes the prompt through, the task's problems as
    verl's parquet, the grader as verl's custom reward function."""
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_parts.task.reasoning import ReasoningTask
    from grpo_parts.train.lifecycle.setup import builtin_model_path

    src = builtin_model_path("reasoning")
    model_dir = workdir / "model"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(model_dir)
    task = ReasoningTask(seed=seed)
    rows = []
    for i in range(n_prompts):
        p = task.train_problem(i)
        rows.append({
            "data_source": "grpo_parts_reasoning", "prompt": [{"role": "user", "content": p.prompt}],
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)}, "extra_info": {"index": i},
        })  # fmt: skip
    pd.DataFrame(rows).to_parquet(workdir / "train.parquet")
    (workdir / "reward.py").write_text(REWARD_FN)
    return {"model": model_dir, "data": workdir / "train.parquet", "reward": workdir / "reward.py"}


def arm_overrides(arm: str, args: argparse.Namespace) -> list[str]:
    from grpo_parts_adapters.verl.config import hydra_overrides as attention
    from grpo_parts_adapters.verl.rollout import hydra_overrides as rollout
    from grpo_parts_adapters.verl.sampler import hydra_overrides as filt

    if arm == "reference":
        return rollout(sampler="reference", draft=None)
    rows = args.prompts * args.group
    return [
        *rollout(sampler="speculative", draft="ngram"),
        *attention("shared_prefix"),
        *filt("cppo", {"k": rows // 2}),
    ]


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from verl_e2e import main_ppo, overrides

    with tempfile.TemporaryDirectory(prefix=f"verl_{arm}_{seed}_") as tmp:
        work = Path(tmp)
        assets = reasoning_assets(work, args.prompts * (args.steps + 1), seed)
        base = overrides(
            assets, work, steps=args.steps, batch=args.prompts, n=args.group, response=args.max_new_tokens
        )
        drop = (
            "data.max_prompt_length",
            "actor_rollout_ref.actor.optim.lr",
            "actor_rollout_ref.actor.ppo_mini",
        )
        base = [o for o in base if not o.startswith(drop)]
        base += [
            "data.max_prompt_length=192",
            f"actor_rollout_ref.actor.optim.lr={args.lr}",
            f"data.seed={seed}",
        ]
        # two mini-batches per step: CPPO's kept half is one whole mini-batch (verl trains whole ones)
        mini = max(1, args.prompts // 2)
        base += [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini * args.group}",
            # the kept half must divide into the log-prob micro-batches too (verl asserts it)
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={mini * args.group}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={mini * args.group}",
        ]
        rows = main_ppo(work, [*base, *arm_overrides(arm, args)], timeout=args.timeout)
    data = [r.get("data", r) for r in rows]
    out: dict[str, Any] = {k.split("/")[-1]: [float(d.get(k, float("nan"))) for d in data] for k in KEYS}
    # verl's critic/score and response_length are over the rows trained (a filter's kept rows): the
    # score both arms compare is every rolled-out row's (the filter's metric; no filter: verl's)
    out["score"] = [float(d.get(ROLLED_OUT_SCORE, d.get("critic/score/mean", float("nan")))) for d in data]
    out["score_trained_rows"] = [float(d.get("critic/score/mean", float("nan"))) for d in data]
    out["response_length"] = [float(d.get("response_length/mean", float("nan"))) for d in data]
    # the rollout backend's counters are cumulative (its last step holds the run's total); the
    # engine's and the filter's are per step (summed)
    keys = [k for k in data[-1] if "parts/" in k]
    out["parts_counters"] = {
        k: float(data[-1][k]) if k.startswith(SAMPLER_PREFIX) else sum(float(d.get(k, 0.0)) for d in data)
        for k in keys
    }
    return out


def summarize(results: dict[str, dict[int, dict[str, Any]]], skip: int) -> dict[str, Any]:
    means = {
        arm: {s: statistics.fmean(r["step"][skip:] or r["step"]) for s, r in seeds.items()}
        for arm, seeds in results.items()
    }
    out: dict[str, Any] = {"step_s_mean": {a: statistics.fmean(m.values()) for a, m in means.items()}}
    if set(ARMS) <= set(means):
        per = {
            s: means["reference"][s] / means["parts"][s] for s in means["parts"] if s in means["reference"]
        }
        out["step_speedup_per_seed"] = per
        out["step_speedup"] = statistics.fmean(per.values()) if per else None
    return out


def plot(results: dict[str, dict[int, dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, seeds in results.items():
        for seed, r in seeds.items():
            wall = [sum(r["step"][: i + 1]) for i in range(len(r["step"]))]
            by_step.plot(range(1, len(r["score"]) + 1), r["score"], marker="o", label=f"{arm} seed {seed}")
            by_time.plot(wall, r["score"], marker="o", label=f"{arm} seed {seed}")
    by_step.set(xlabel="verl step", ylabel="mean score", title="reward per step (verl main_ppo)")
    by_time.set(xlabel="wall seconds (timing_s/step)", ylabel="mean score", title="reward against time")
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms to run")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="one run per arm per seed")
    p.add_argument("--steps", type=int, default=6, help="verl training steps per run")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (data.train_batch_size)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (rollout.n)")
    p.add_argument("--max-new-tokens", type=int, default=320, help="data.max_response_length")
    p.add_argument("--lr", type=float, default=1e-4, help="actor learning rate (the main job's)")
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps left out of the mean step time")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one main_ppo run may take")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="plot reward against step and wall time here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:  # alternating: drift of the machine falls on both arms
            results[arm][seed] = run_arm(arm, seed, args)
            r = results[arm][seed]
            print(
                f"{arm:>9} seed {seed}: step s {[round(x, 1) for x in r['step']]} score {r['score']}",
                flush=True,
            )
    summary = summarize(results, args.skip_first)
    report = {
        "workload": {k: getattr(args, k) for k in ("steps", "prompts", "group", "max_new_tokens", "lr")},
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "arms": {arm: {"seeds": seeds} for arm, seeds in results.items()},
        **summary,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
