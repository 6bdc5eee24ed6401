#!/usr/bin/env python
"""GPU smoke run of grpo_parts inside a real verl 0.9.1 GRPO run (needs CUDA, vLLM and verl's full
dependency set; not run in CI). Builds a tiny random Qwen2 model + char tokenizer and a toy "repeat
the digit" dataset in --workdir, then:

1. first-batch check (``--attention``): verl's own FSDP engine (``--strategy``, verl's default
   ``fsdp``) built twice from the model, with the attention part on and off, ``infer_batch`` on the
   same first batch (prompts of the dataset, random completions): log-probs must agree
   (``--atol``), every micro-batch must go through grpo_parts;
2. ``python -m verl.trainer.main_ppo`` for --steps steps under verl's default v1 trainer with the
   parts chosen on the command line switched on by the config keys of docs/adapters/verl.md, and
   verl's file logger on; the per-step metrics must show the parts ran (attention forwards > 0,
   no fallbacks; filter rows kept > 0) and a finite loss.

Writes the checks and the last step's metrics as JSON (``--out``, default
docs/verl_gpu_smoke.json) and exits 1 when a check fails::

    python scripts/gpu/verl_gpu_smoke.py --workdir /tmp/verl_smoke --filter cppo --attention shared_prefix \\
        --agent-loop --speculative ngram --steps 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
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
        "actor_rollout_ref.actor.use_kl_loss=True",
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
        "trainer.logger=[console,file]",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={workdir / 'metrics.jsonl'}",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
    ]
    if args.filter:
        from grpo_parts_adapters.verl.sampler import hydra_overrides as filter_overrides

        kw = {"cppo": {"k": 8}, "pods": {"m": 2}, "zero_variance": {}}[args.filter]
        o += filter_overrides(args.filter, kw)
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
        from grpo_parts_adapters.verl.speculative import hydra_overrides

        from grpo_parts.sampler.vllm import VLLMSpeculative

        o += hydra_overrides(VLLMSpeculative(method="ngram", num_speculative_tokens=3))
    if args.attention:
        from grpo_parts_adapters.verl.config import hydra_overrides

        o += hydra_overrides(args.attention)
    return o


# ------------------------------------------------------------------------------ first-batch check


def first_batch(tokenizer: Any, n_prompts: int = 4, n: int = 4, max_response: int = 8, seed: int = 0) -> Any:
    """verl's nested micro-batch layout for ``n_prompts`` dataset prompts x ``n`` random completions."""
    import torch
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    nested = tu.nested_tensor_from_tensor_list
    prompts, responses, uids = [], [], []
    for i in range(n_prompts):
        p = torch.tensor(tokenizer.encode(f"repeat {i % 10}:"), dtype=torch.long)
        for _ in range(n):
            k = int(torch.randint(1, max_response + 1, (1,), generator=g))
            prompts.append(p)
            responses.append(torch.randint(3, len(tokenizer), (k,), generator=g))
            uids.append(f"p{i}")
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    return tu.get_tensordict(
        {
            "input_ids": nested(seqs),
            "position_ids": nested([torch.arange(len(s)) for s in seqs]),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "response_mask": nested([torch.ones_like(r) for r in responses]),
            "loss_mask": nested([torch.ones_like(r) for r in responses]),
            "uid": uids,
        },
        non_tensor_dict={
            "use_remove_padding": True,
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": n * 2,
            "max_token_len_per_gpu": 4096,
            "use_fused_kernels": False,
            "temperature": 1.0,
            "calculate_entropy": True,
        },
    )


def first_batch_check(
    model_dir: Path | str,
    *,
    attention: str = "shared_prefix",
    strategy: str = "fsdp",
    attn_implementation: str = "sdpa",
    param_dtype: str = "fp32",
) -> dict[str, Any]:
    """verl's ``FSDPEngineWithLMHead`` with the attention part on vs off (config keys -> our
    ``FSDPActorConfig``), ``infer_batch`` on :func:`first_batch`. Needs an initialised process group."""
    import torch
    from grpo_parts_adapters.verl.config import FSDPActorConfig
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.padding import no_padding_2_padding

    mp = {"param_dtype": param_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    outputs, tok = {}, None
    for name, grpo_parts in (("on", {"attention": attention}), ("off", {})):
        model = HFModelConfig(
            path=str(model_dir), override_config={"attn_implementation": attn_implementation}
        )
        tok = model.tokenizer
        actor = FSDPActorConfig(
            strategy=strategy,
            rollout_n=4,
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=8,
            fsdp_config=FSDPEngineConfig(strategy=strategy, mixed_precision=mp, use_torch_compile=False),
            optim=FSDPOptimizerConfig(lr=1e-6, total_training_steps=1),
            grpo_parts=grpo_parts,
        )
        engine = FSDPEngineWithLMHead(model, actor.engine, actor.optim, CheckpointConfig())
        engine.initialize()
        with engine.eval_mode():
            outputs[name] = engine.infer_batch(first_batch(tok))
    data = first_batch(tok)
    on, off = (
        no_padding_2_padding(outputs[k]["model_output"]["log_probs"], data).float() for k in ("on", "off")
    )
    mask = torch.nested.to_padded_tensor(data["response_mask"], 0).bool()
    counts = {k: float(v.aggregate()) for k, v in outputs["on"]["metrics"].items() if k.startswith("parts/")}
    return {
        "strategy": strategy,
        "attn_implementation": attn_implementation,
        "param_dtype": param_dtype,
        "max_abs_diff_log_probs": float((on - off).abs()[mask].max()),
        "micro_batches": len(outputs["on"]["loss"]),
        **counts,
        "finite": bool(torch.isfinite(on[mask]).all()),
    }


# ------------------------------------------------------------------------------ run checks


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """verl's file logger: one ``{"step": s, "data": {...}}`` line per step."""
    return [json.loads(line)["data"] for line in path.read_text().splitlines() if line.strip()]


def check_run(steps: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, bool]:
    """What the per-step metrics must show for the parts switched on in ``args``."""
    checks: dict[str, bool] = {"steps_logged": len(steps) >= args.steps}
    loss = [s.get("actor/pg_loss") for s in steps]
    checks["loss_finite"] = bool(loss) and all(v is not None and math.isfinite(v) for v in loss)
    if args.attention:
        checks["attention_ran"] = all(s.get("actor/parts/attention/forwards", 0) > 0 for s in steps)
        checks["attention_no_fallback"] = all(s.get("actor/parts/attention/fallbacks", 1) == 0 for s in steps)
        checks["logprob_passes_ran"] = all(
            s.get("actor/parts/attention/logprob_forwards", 0) > 0 for s in steps
        )
    if args.filter:
        checks["filter_kept_rows"] = all(s.get("parts/filter/rows_kept", 0) > 0 for s in steps)
    return checks


def check_first_batch(result: dict[str, Any], atol: float) -> dict[str, bool]:
    return {
        "first_batch_logprobs_equal": result["finite"] and result["max_abs_diff_log_probs"] <= atol,
        "first_batch_attention_ran": result.get("parts/attention/forwards", 0) == result["micro_batches"] > 0,
        "first_batch_no_fallback": result.get("parts/attention/fallbacks", 1) == 0,
    }


def _machine() -> str:
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except Exception as e:  # pragma: no cover - reporting only
        gpu = f"unknown ({e})"
    return f"{platform.node()} {platform.machine()} {gpu}"


def _run_first_batch_check(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method="tcp://127.0.0.1:29577", rank=0, world_size=1
        )
    try:
        return first_batch_check(model_dir, attention=args.attention, strategy=args.strategy)
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/grpo_parts_verl_smoke"),
        help="model, data and logs are written here",
    )
    p.add_argument("--steps", type=int, default=3, help="verl GRPO steps (default: 3)")
    p.add_argument("--prompts", type=int, default=64, help="prompts in the toy dataset (default: 64)")
    p.add_argument(
        "--filter",
        choices=["cppo", "zero_variance", "pods"],
        default=None,
        help="the filter part to switch on (default: none)",
    )
    p.add_argument(
        "--attention",
        choices=["shared_prefix", "reference"],
        default=None,
        help="the attention part to switch on, and the first-batch check (default: none)",
    )
    p.add_argument("--strategy", choices=["fsdp", "fsdp2"], default="fsdp", help="first-batch check engine")
    p.add_argument("--atol", type=float, default=1e-4, help="first-batch log-prob tolerance (fp32, sdpa)")
    p.add_argument(
        "--agent-loop",
        action="store_true",
        help="roll out through verl's agent loop with grpo_parts' GrpoPartsAgentLoop",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="vLLM speculative decoding in the rollout (default: off)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "verl_gpu_smoke.json",
        help="the JSON report (default: docs/verl_gpu_smoke.json)",
    )
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
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "command": " ".join(sys.argv),
        "checks": {},
    }
    if args.attention:
        report["first_batch"] = _run_first_batch_check(args, model_dir)
        report["checks"].update(check_first_batch(report["first_batch"], args.atol))
    metrics = args.workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(metrics))
    report["returncode"] = subprocess.run(cmd, env=env).returncode
    steps = read_metrics(metrics) if metrics.exists() else []
    report["checks"].update(check_run(steps, args))
    report["checks"]["exit_code_zero"] = report["returncode"] == 0
    report["last_step"] = {
        k: v for k, v in (steps[-1] if steps else {}).items() if isinstance(v, (int, float))
    }
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    failed = [k for k, ok in report["checks"].items() if not ok]
    print(f"wrote {args.out}; failed checks: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
