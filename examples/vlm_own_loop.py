"""Your own GRPO loop for a vision-language policy: each image encoded once per group.

    python examples/vlm_own_loop.py --json /tmp/vlm.json
    torchrun --nproc_per_node 2 examples/vlm_own_loop.py --json /tmp/vlm.json   # DDP, gloo, CPU

A tiny Qwen2.5-VL (random weights, built from a config) learns to answer "how many images?" with
token ``3 + count``. Each step: roll out with the reference sampler (each prompt and its images
prefilled once, the cache shared by its group), reward, group advantages, CPPO keeps half the rows,
the shared-prefix attention scores the kept rows with each prompt's images once per group (the
vision tower runs once per prompt, not once per completion), grpo_loss, backward, step. Under DDP
every rank draws its own prompts (different image counts, so different shapes); the attention
backend makes the ranks agree on the number of forwards and the forwards run through the wrapper.
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
from grpo_parts.build import build_attention, build_filter, build_sampler
from grpo_parts.core import AdvantageConfig, LossConfig, group_advantages, grpo_loss
from grpo_parts.filter import ScoredBatch
from grpo_parts.filter.apply import KeptBatch, apply_filter, loss_denominators
from grpo_parts.sampler import PromptBatch, SamplingParams
from grpo_parts.tiny_vision import tiny_image, tiny_vlm
from grpo_parts.types import VisionInputs

VOCAB = 16
ANSWER = 3  # the right first token for a prompt with n images is ANSWER + n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="GRPO steps (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, images and sampling")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the step records here")
    return p.parse_args(argv)


def image_prompts(model: torch.nn.Module, counts: list[int], gen: torch.Generator) -> PromptBatch:
    """One prompt per entry of ``counts``: that many random images, a text token after each."""
    rows, per_prompt = [], []
    for n in counts:
        ids, parts = [1], []
        for _ in range(n):
            tokens, inputs = tiny_image(model, int(torch.randint(1, 3, (1,), generator=gen)), gen)
            ids += tokens + [5]
            parts.append(inputs)
        rows.append(ids)
        per_prompt.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    text = PromptBatch.from_lists(rows, pad_token_id=0)
    return PromptBatch(text.input_ids, text.attention_mask, VisionInputs(tuple(per_prompt)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)
    model: Any = tiny_vlm("qwen2_5_vl", vocab_size=VOCAB, seed=args.seed).train()
    wrapped: Any = DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sampler = build_sampler("reference", model)  # samples from the weights being trained
    attention = build_attention("shared_prefix")
    completion_filter = build_filter("cppo", kwargs={"pruning_rate": 0.5})
    params = SamplingParams(group_size=args.group_size, max_new_tokens=2, temperature=1.0, pad_token_id=0)
    loss_config = LossConfig()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own prompts
    tower_calls: list[int] = []
    model.model.visual.register_forward_hook(lambda m, a, o: tower_calls.append(int(a[0].shape[0])))
    records: list[dict[str, Any]] = []

    for step in range(args.steps):
        t0 = time.perf_counter()
        counts = torch.randint(1, 3, (args.prompts,), generator=gen).tolist()
        prompts = image_prompts(model, counts, gen)
        rollout = sampler.generate(prompts, params, gen)
        right = torch.tensor([ANSWER + counts[g] for g in rollout.group_index.tolist()])
        rewards = (rollout.completion_ids[:, 0] == right).float()
        advantages = group_advantages(rewards, rollout.group_index, AdvantageConfig())

        scored = ScoredBatch(rewards, advantages, rollout.group_index, rollout.completion_lengths())
        kept = apply_filter(completion_filter.select(scored), rollout, advantages)
        if kept.rollout is None:  # every advantage 0: train on all rows (a zero loss)
            every = torch.arange(rollout.num_completions)
            kept = KeptBatch(rollout, advantages, every, *loss_denominators(rollout.completion_mask))
        batch = kept.rollout
        assert batch is not None and batch.vision is not None  # the kept rows keep their images
        tower_calls.clear()
        logps = attention.completion_logprobs(wrapped, LogprobBatch.from_rollout(batch)).logprobs
        patches = sum(tower_calls)  # what the vision tower ran on in the training forward
        out = grpo_loss(
            logps, batch.logprobs.float(), kept.advantages, batch.completion_mask, loss_config,
            num_tokens=kept.num_tokens, num_seqs=kept.num_seqs,
        )  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        repeated = sum(
            int(batch.vision.gather([g])["pixel_values"].shape[0]) for g in batch.group_index.tolist()
        )
        record = {
            "rank": rank,
            "step": step,
            "loss": out.loss.item(),
            "reward": float(rewards.mean()),
            "kept": kept.size,
            "completions": rollout.num_completions,
            "attention_layout": str(attention.last_plan.get("layout", "")),  # type: ignore[attr-defined]
            "tower_patches": patches,
            "tower_patches_repeated": repeated,  # what re-encoding each image per completion runs
            "seconds": time.perf_counter() - t0,
        }
        records.append(record)
        print(
            f"[rank {rank}] step {step}: reward {record['reward']:.3f} loss {record['loss']:+.4f} kept {kept.size}/"
            f"{rollout.num_completions} vision tower {patches} patches (per completion: {repeated}) "
            f"{record['seconds']:.2f}s",
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
