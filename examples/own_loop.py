"""Your own GRPO loop in plain PyTorch, with the four parts and no trainer class of ours.

    python examples/own_loop.py                                  # one process
    torchrun --nproc_per_node 2 examples/own_loop.py --json /tmp/own_loop.json  # DDP, gloo, CPU

Each step, on every rank: roll out the rank's own prompts with the speculative sampler (n-gram draft),
grade them with the built-in arithmetic task, compute group advantages, keep half of the completions
with CPPO, get log-probs with the shared-prefix attention *through the DDP wrapper*, then
grpo_loss -> backward -> optimizer step. The sampler decodes with the inner model (no grad, no
collectives), so ranks may decode different lengths; the attention backend makes the ranks agree
on the number of forwards, so DDP's gradient all-reduce always matches up.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from grpo_parts.attention import LogprobBatch
from grpo_parts.attention.protocol import PLAN_CHUNKS
from grpo_parts.build import build_attention, build_draft, build_filter, build_sampler
from grpo_parts.core import AdvantageConfig, LossConfig, group_advantages, grpo_loss
from grpo_parts.filter import ScoredBatch
from grpo_parts.filter.apply import KeptBatch, apply_filter, loss_denominators
from grpo_parts.sampler import SamplingParams
from grpo_parts.task.arithmetic import ArithmeticConfig, ArithmeticTask
from grpo_parts.task.data import decode_completions, encode_prompts
from grpo_parts.train.lifecycle.setup import builtin_model_path, eos_ids, load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="GRPO steps (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights' init, data and sampling")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rank per step (default 4)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="completion length limit (default 48)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every rank's step records here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # fastest for a tiny model on a CPU
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)

    policy, tokenizer = load_model(builtin_model_path(), torch.float32, torch.device("cpu"), progress=False)
    model: torch.nn.Module = DistributedDataParallel(policy) if distributed else policy
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    task = ArithmeticTask(ArithmeticConfig(max_value=30), seed=args.seed)  # terms <= 30: some right

    # the four parts, through the public builder; each takes the DDP-wrapped model as it is
    draft = build_draft("ngram", model)
    sampler = build_sampler(
        "speculative", model, draft=draft,  # decodes with the inner model (no DDP forward)
        kwargs={"draft_tokens": 4, "decode_shared_prompt": "always", "train_draft": False},
    )  # fmt: skip
    attention = build_attention("shared_prefix")  # forwards run through the DDP wrapper
    completion_filter = build_filter("cppo", kwargs={"pruning_rate": 0.5})

    eos = eos_ids(policy, tokenizer)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0])
    params = SamplingParams(
        group_size=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0,
        eos_token_ids=eos, pad_token_id=pad,
    )  # fmt: skip
    loss_config = LossConfig(eps_low=0.2, eps_high=0.28)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank samples its own
    records: list[dict[str, Any]] = []

    for step in range(args.steps):
        t0 = time.perf_counter()
        first = (step * world + rank) * args.prompts  # each rank its own slice of the problem stream
        problems = [task.train_problem(first + i) for i in range(args.prompts)]
        rollout = sampler.generate(encode_prompts(tokenizer, [p.prompt for p in problems]), params, generator)

        texts = decode_completions(tokenizer, rollout)
        rows = [problems[g] for g in rollout.group_index.tolist()]
        rewards = torch.tensor([task.reward(t, p) for t, p in zip(texts, rows)], dtype=torch.float32)
        advantages = group_advantages(rewards, rollout.group_index, AdvantageConfig())

        scored = ScoredBatch(rewards, advantages, rollout.group_index, rollout.completion_lengths())
        kept = apply_filter(completion_filter.select(scored), rollout, advantages)
        if kept.rollout is None:  # all advantages 0: a zero loss, but every rank runs the same calls
            every = torch.arange(rollout.num_completions)
            kept = KeptBatch(rollout, advantages, every, *loss_denominators(rollout.completion_mask))
        batch = kept.rollout
        assert batch is not None

        logps = attention.completion_logprobs(model, LogprobBatch.from_rollout(batch)).logprobs
        out = grpo_loss(
            logps, batch.logprobs.float(), kept.advantages, batch.completion_mask, loss_config,
            num_tokens=kept.num_tokens, num_seqs=kept.num_seqs,
        )  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        sampler.sync_weights(model)
        with torch.no_grad():  # the same batch's loss after the step: the update lowered it
            new = attention.completion_logprobs(model, LogprobBatch.from_rollout(batch)).logprobs
            after = grpo_loss(
                new, batch.logprobs.float(), kept.advantages, batch.completion_mask, loss_config,
                num_tokens=kept.num_tokens, num_seqs=kept.num_seqs,
            ).loss  # fmt: skip

        stats = dict(rollout.stats)
        plan = getattr(attention, "last_plan", {})
        record = {
            "rank": rank,
            "step": step,
            "loss": out.loss.item(),
            "loss_after": after.item(),
            "reward": float(rewards.mean()),
            "kept": kept.size,
            "completions": rollout.num_completions,
            "lean_forward_calls": float(stats.get("lean_forward_calls", 0.0)),
            "decode_attention_shared_prefix_calls": float(
                stats.get("decode_attention_shared_prefix_calls", 0.0)
            ),
            "attention_layout": str(plan.get("layout", "")),
            "attention_grids": int(plan.get(PLAN_CHUNKS, 0)),
            "attention_calls": dict(getattr(attention, "attention_calls", {})),
            "attention_layout_counts": dict(getattr(attention, "layout_counts", {})),
            "seconds": time.perf_counter() - t0,
        }
        records.append(record)
        print(
            f"[rank {rank}] step {step}: loss {record['loss']:+.4f} -> {record['loss_after']:+.4f} reward {record['reward']:.3f} "
            f"kept {kept.size}/{rollout.num_completions} lean_forward_calls {record['lean_forward_calls']:g} "
            f"decode_attention_shared_prefix_calls {record['decode_attention_shared_prefix_calls']:g} "
            f"attention layout {record['attention_layout']} calls {record['attention_layout_counts']} "
            f"{record['seconds']:.1f}s",
            flush=True,
        )

    gathered: list[Any] = [records]
    if distributed:
        gathered = [None] * world
        dist.all_gather_object(gathered, records)
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"world_size": world, "ranks": gathered}, f, indent=1)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
