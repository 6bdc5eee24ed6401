"""``grpo-parts bench e2e --preset NAME``: GRPO throughput per arm on a policy shaped like a real LLM.

Nothing is downloaded: a random policy shaped like the preset's model (the built-in task's tokenizer
inside the real vocabulary size) gets a short SFT on the task, then each arm (``reference``,
``optimized``, ``vllm`` when installed) runs a few GRPO steps through ``grpo-parts train``'s trainer.
Reported per arm (NeMo-RL style): generated tokens/s/GPU, rollout tokens/s, mean step time after the
warm-up step, phase shares, mean completion length. ``tiny`` is a CPU preset for the tests.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import GRPOPartsError
from ..sampler.stats import ACCEPTED_PER_VERIFY

#: preset -> model shape (Qwen2 family), SFT steps and batch, GRPO steps, prompts per step, G, dtype
PRESETS: dict[str, dict[str, Any]] = {
    "h200": {  # Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads (2 KV), MLP 4864, vocab 151936, tied
        "model": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                      vocab_size=151936, tie_word_embeddings=True),
        "label": "Qwen2.5-0.5B-shaped (random init + SFT on the built-in reasoning task)",
        "sft_steps": 300, "sft_batch": 64, "sft_lr": 3e-4,
        # 128 rows; 4 optimizer minibatches keep the 151,936-wide logits of the update within memory
        "steps": 6, "prompts_per_step": 16, "group_size": 8, "minibatches": 4, "dtype": "bfloat16",
    },
    "tiny": {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      vocab_size=64, tie_word_embeddings=False),
        "label": "tiny test policy",
        "sft_steps": 2, "sft_batch": 4, "sft_lr": 1e-3,
        "steps": 2, "prompts_per_step": 2, "group_size": 4, "dtype": "float32", "max_new_tokens": 16,
    },
}  # fmt: skip


def build_policy(preset: dict[str, Any], device: torch.device, out: Path) -> tuple[int, float]:
    """Random-init policy of the preset's shape, SFT on worked solutions, saved (with the tokenizer)
    to ``out``. Returns (parameters, SFT seconds)."""
    from ..compat import portable_tokenizer_config
    from ..task.reasoning import CHARS, ReasoningTask
    from ..task.tokenizer import EOS_ID, PAD_ID, build_hf_tokenizer
    from ..tiny import tiny_causal_lm
    from .draft_training import padded_rows

    tok = build_hf_tokenizer(CHARS)
    shape = dict(preset["model"])
    if shape["vocab_size"] < len(tok):
        raise GRPOPartsError(f"preset: vocab_size {shape['vocab_size']} < the task's {len(tok)} tokens")
    model = tiny_causal_lm(
        "qwen2", max_position_embeddings=1024, eos_token_id=EOS_ID, pad_token_id=PAD_ID, seed=0, **shape
    ).to(device)
    task = ReasoningTask(seed=10_000)
    opt = torch.optim.AdamW(model.parameters(), lr=preset["sft_lr"], weight_decay=0.0)
    dtype = torch.bfloat16 if preset["dtype"] == "bfloat16" else torch.float32
    model.train()
    t0, pos, rng = time.perf_counter(), 0, random.Random(0)
    for step in range(1, preset["sft_steps"] + 1):
        rows = []
        for _ in range(preset["sft_batch"]):
            p = task.train_problem(pos + rng.randrange(8))
            pos += 1
            rows.append((tok.encode(p.prompt), tok.encode(task.sft_target(p)) + [EOS_ID]))
        ids, labels, mask = padded_rows(rows, PAD_ID)
        for g in opt.param_groups:
            g["lr"] = preset["sft_lr"] * min(1.0, step / 20)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(
                input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)
            ).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    sft_s = time.perf_counter() - t0
    model.eval()
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    tok.save_pretrained(out)
    portable_tokenizer_config(out)
    return sum(p.numel() for p in model.parameters()), sft_s


def arm_parts(arm: str) -> dict[str, Any]:
    from ..train.config import REFERENCE_PARTS

    if arm == "reference":
        return dict(REFERENCE_PARTS)
    if arm == "vllm":
        return {"sampler": "vllm", "draft": None}
    return {}


def run_arm(arm: str, model_dir: Path, preset: dict[str, Any], device: str, out: Path) -> dict[str, Any]:
    """A few GRPO steps of one arm; the per-step rows and the arm's headline numbers."""
    from ..train.config import load_config
    from ..train.lifecycle.run import build_trainer

    over: dict[str, Any] = {
        "model": str(model_dir), "out_dir": str(out), "name": arm, "device": device, "dtype": preset["dtype"],
        "task": {"name": "reasoning"}, "steps": preset["steps"], "prompts_per_step": preset["prompts_per_step"],
        "group_size": preset["group_size"], "progress": False, "lr": 1e-6, "eval_every": 10_000,
    }  # fmt: skip
    over.update({k: preset[k] for k in ("max_new_tokens", "minibatches") if k in preset})
    parts = arm_parts(arm)
    if parts:
        over["parts"] = parts
    cfg = load_config(None, over)
    trainer, _ = build_trainer(cfg)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    rows = []
    for _ in range(cfg.steps):
        sync()
        rows.append(trainer.step())
        sync()
    steady = rows[1:] or rows  # the first step warms up (calibration, kernels)
    step_s = sum(r["time_step"] for r in steady) / len(steady)
    tokens = sum(r["completion_len"] * r["prompts"] * cfg.group_size for r in steady) / len(steady)
    phases = {k: sum(r.get(f"time_{k}", 0.0) for r in steady) / len(steady) for k in
              ("rollout", "logprobs", "update", "draft", "other")}  # fmt: skip
    return {
        "arm": arm,
        "parts": trainer.parts.describe(),
        "step_s": step_s,
        "tokens_per_s_per_gpu": tokens / step_s if step_s > 0 else None,
        "rollout_tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "mean_completion_len": sum(r["completion_len"] for r in steady) / len(steady),
        "phase_shares": {k: v / step_s if step_s > 0 else None for k, v in phases.items()},
        "phase_s": phases,
        ACCEPTED_PER_VERIFY: rows[-1].get(ACCEPTED_PER_VERIFY),
        "rows": rows,
    }


def run_preset(name: str, device: str, json_path: Path | None = None) -> dict[str, Any]:
    import importlib.util

    if name not in PRESETS:
        raise GRPOPartsError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    preset = PRESETS[name]
    from ..train.lifecycle.setup import resolve_device

    dev = resolve_device(device)
    arms = ["reference", "optimized"]
    if dev.type == "cuda" and importlib.util.find_spec("vllm") is not None:
        arms.append("vllm")
    with tempfile.TemporaryDirectory(prefix="grpo-parts-e2e-") as tmp:
        model_dir = Path(tmp) / "policy"
        params, sft_s = build_policy(preset, dev, model_dir)
        results = {arm: run_arm(arm, model_dir, preset, dev.type, Path(tmp) / "runs") for arm in arms}
    from ..task.reasoning import ReasoningTask

    max_new = preset.get("max_new_tokens", 320)
    task = ReasoningTask()  # the longest prompt (one token per character) + the new tokens
    ctx = len(task.problem([9] * task.config.long_max_terms).prompt) + max_new
    ref = results["reference"]["step_s"]
    out = {
        "preset": name, "model": preset["label"], "parameters": params, "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "dtype": preset["dtype"],
        "context_length": ctx, "max_new_tokens": max_new, "group_size": preset["group_size"],
        "prompts_per_step": preset["prompts_per_step"], "steps": preset["steps"], "sft_s": sft_s,
        "arms": {a: {k: v for k, v in r.items() if k != "rows"} for a, r in results.items()},
        "step_speedup": {a: ref / r["step_s"] if r["step_s"] else None for a, r in results.items()},
    }  # fmt: skip
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2) + "\n")
    out["markdown"] = markdown(out)
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# GRPO end to end, preset {res['preset']}: {res['model']}",
        "",
        f"{res['parameters'] / 1e6:.0f}M parameters, {res['dtype']}, {res['gpu'] or res['device']}; "
        f"context {res['context_length']} (max new tokens {res['max_new_tokens']}), "
        f"{res['prompts_per_step']} prompts x G={res['group_size']}, {res['steps']} steps per arm "
        f"(first excluded); SFT {res['sft_s']:.0f} s.",
        "",
        "| arm | tokens/s/GPU | rollout tokens/s | step (s) | step speedup | rollout | logprobs | update | "
        "draft | other | mean completion | accepted/verify |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, r in res["arms"].items():
        sh = r["phase_shares"]
        apv = r["accepted_per_verify"]
        lines.append(
            f"| {arm} | {r['tokens_per_s_per_gpu']:.0f} | {r['rollout_tokens_per_s']:.0f} | {r['step_s']:.2f} "
            f"| {res['step_speedup'][arm]:.2f}x | "
            + " | ".join(f"{(sh[k] or 0):.0%}" for k in ("rollout", "logprobs", "update", "draft", "other"))
            + f" | {r['mean_completion_len']:.0f} | {'-' if apv is None else f'{apv:.2f}'} |"
        )
    return "\n".join(lines) + "\n"
