#!/usr/bin/env python
"""GPU smoke run of grpo_parts inside a real verl 0.9.1 GRPO run (needs CUDA, vLLM and verl's full
dependency set; not run in CI). Builds a tiny random Qwen2 model + char tokenizer and a toy
"repeat the digit" dataset in --workdir, then runs ``python -m verl.trainer.main_ppo`` for --steps
steps with the parts chosen on the command line switched on by the overrides of
docs/adapters/verl.md. Exit status is verl's.

    python scripts/verl_gpu_smoke.py --workdir /tmp/verl_smoke --filter cppo --attention shared_prefix \\
        --agent-loop --speculative ngram --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the completion starts with the ground-truth digit, else 0.0."""
    return float(solution_str.strip()[:1] == str(ground_truth))
'''


def build_assets(workdir: Path, n_prompts: int) -> tuple[Path, Path, Path]:
    import pandas as pd
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo_parts.tiny import tiny_causal_lm

    chars = "0123456789abcdefghijklmnopqrstuvwxyz :?"
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate([*specials, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    hf_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model_dir = workdir / "model"
    model = tiny_causal_lm(
        "qwen2", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, dtype=torch.float32
    )
    model.config.eos_token_id, model.config.pad_token_id = 1, 0
    model.save_pretrained(model_dir)
    hf_tok.save_pretrained(model_dir)
    rows = []
    for i in range(n_prompts):
        d = i % 10
        rows.append(
            {
                "data_source": "grpo_parts_smoke",
                "prompt": [{"role": "user", "content": f"repeat {d}:"}],
                "reward_model": {"style": "rule", "ground_truth": str(d)},
                "extra_info": {"index": i},
            }
        )
    data = workdir / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    reward = workdir / "reward.py"
    reward.write_text(REWARD_FN)
    return model_dir, data, reward


def overrides(
    args: argparse.Namespace, model_dir: Path, data: Path, reward: Path, workdir: Path
) -> list[str]:
    o = [
        "algorithm.adv_estimator=grpo_parts_grpo",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.train_batch_size=8",
        "data.max_prompt_length=16",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.external_lib=grpo_parts_adapters.verl.plugin",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
    ]
    if args.filter:
        kw = {
            "cppo": "+grpo_parts.filter.kwargs.k=8",
            "pods": "+grpo_parts.filter.kwargs.m=2",
            "zero_variance": None,
        }
        o += [
            "trainer.use_v1=True",
            "trainer.v1.trainer_mode=grpo_parts_sync",
            f"+grpo_parts.filter.name={args.filter}",
        ]
        o += [x for x in [kw[args.filter]] if x]
    if args.agent_loop:
        cfg = workdir / "agent_loops.yaml"
        cfg.write_text(
            "- name: grpo_parts_agent\n  _target_: grpo_parts_adapters.verl.agent_loop.GrpoPartsAgentLoop\n  sampler: server\n"
        )
        o += [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={cfg}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=grpo_parts_agent",
        ]
    if args.speculative == "ngram":
        from grpo_parts_adapters.verl.speculative import VllmSpeculativeOptions

        o += VllmSpeculativeOptions(method="ngram", num_speculative_tokens=3).hydra_overrides()
    if args.attention:
        o.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.GRPO_PARTS_VERL_ATTENTION={args.attention}")
    return o


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/grpo_parts_verl_smoke"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--filter", choices=["cppo", "zero_variance", "pods"], default=None)
    p.add_argument("--attention", choices=["shared_prefix", "reference"], default=None)
    p.add_argument("--agent-loop", action="store_true")
    p.add_argument("--speculative", choices=["ngram"], default=None)
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir, data, reward = build_assets(args.workdir, args.prompts)
    cmd = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        *overrides(args, model_dir, data, reward, args.workdir),
    ]
    print(json.dumps(cmd, indent=1))
    if args.dry_run:
        return 0
    env = dict(os.environ)
    if args.attention:
        env["GRPO_PARTS_VERL_ATTENTION"] = args.attention
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
