"""Does online draft learning keep acceptance up while the policy trains? (the policy-drift experiment)

A policy is first trained on a task, an EAGLE head is distilled from its features on task text and
then from a few of its rollouts, and the head is copied into a *frozen* and an *online* draft (the
weight-free n-gram draft runs alongside for reference). The policy then keeps training (drift); after
every round both drafts roll out the same prompts with the same fixed draft length and we record
tokens per verification. The online draft also distils from each of its rollouts (one step behind
the policy, as in FastGRPO); the frozen one never changes. docs/results.md, "Acceptance under policy
drift", has the numbers.

    python scripts/measure/draft_drift.py --rounds 4 [--seed 0] [--json drift.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from grpo_parts.bench.draft_training import (
    sft_steps,
    task_data,
    text_batch,
    warm_up,
)
from grpo_parts.decoding import SamplingParams
from grpo_parts.errors import GRPOPartsError
from grpo_parts.sampler.stats import ACCEPTED_PER_VERIFY, DRAFT_ACCEPT_RATE
from grpo_parts.types import PromptBatch


def _drift_policy(
    seed: int, pretrain_steps: int, progress: Callable[[str], None]
) -> tuple[str, Callable[[int], tuple[list[int], list[int]]], int, int, torch.nn.Module, Any, int]:
    """The drift experiment's policy, pre-trained ``pretrain_steps`` SFT steps on the task: returns
    ``(task name, problem, eos, pad, policy, optimizer, next problem index)`` (the optimizer and
    index carry on into the drift rounds)."""
    from grpo_parts.tiny import tiny_causal_lm

    torch.manual_seed(seed)
    task_name, problem, vocab, eos, pad = task_data(seed)
    policy = tiny_causal_lm(
        "qwen2", vocab_size=vocab, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384,
        seed=seed, eos_token_id=eos, pad_token_id=pad,
    )  # fmt: skip
    opt = torch.optim.AdamW(policy.parameters(), lr=2e-3)
    t0 = time.perf_counter()
    pos = sft_steps(policy, opt, problem, 0, pretrain_steps, 32, pad)
    progress(
        f"drift: policy pre-trained {pretrain_steps} steps on {task_name} ({time.perf_counter() - t0:.0f}s)"
    )
    return task_name, problem, eos, pad, policy, opt, pos


def _drift_heads(
    policy: torch.nn.Module,
    problem: Callable[[int], tuple[list[int], list[int]]],
    pad: int,
    prompts: Callable[[int], PromptBatch],
    params: SamplingParams,
    text_batches: int,
    warmup_rollouts: int,
    seed: int,
    progress: Callable[[str], None],
) -> tuple[Any, Any]:
    """``(online, frozen)`` EAGLE heads, both distilled offline on task text first (as EAGLE heads
    are trained before deployment), then on ``warmup_rollouts`` rollouts; ``frozen`` is a copy."""
    from grpo_parts.draft.eagle import EagleConfig, EagleDraft

    online = EagleDraft(policy, EagleConfig(lr=3e-3, ce_weight=1.0, seed=seed))
    t0 = time.perf_counter()
    for i in range(text_batches):
        online.update(text_batch(policy, problem, 5_000_000 + 32 * i, 32, pad))
    progress(
        f"drift: eagle head distilled on {text_batches} batches of task text ({time.perf_counter() - t0:.0f}s)"
    )
    hist = warm_up(online, policy, lambda i: prompts(-1 - i), params, warmup_rollouts, seed)
    progress(
        f"drift: eagle head distilled on {warmup_rollouts} rollouts, accepted/verify {[round(h, 2) for h in hist]}"
    )
    frozen = copy.deepcopy(online)
    frozen.bind_policy(policy)  # deepcopy copied the policy's embedding; share the live one
    return online, frozen


def _drift_samplers(policy: torch.nn.Module, online: Any, frozen: Any, draft_tokens: int) -> dict[str, Any]:
    """The three drafts under comparison, each in its own speculative sampler: the weight-free
    n-gram draft (reference), the frozen head and the online head (distils from its rollouts)."""
    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler

    return {
        "ngram": SpeculativeSampler(policy, NGramDraft(), SpeculativeConfig(draft_tokens=draft_tokens)),
        "eagle_frozen": SpeculativeSampler(policy, frozen, SpeculativeConfig(draft_tokens=draft_tokens, train_draft=False)),
        "eagle_online": SpeculativeSampler(policy, online, SpeculativeConfig(draft_tokens=draft_tokens, train_draft=True)),
    }  # fmt: skip


def _drift_round(
    r: int,
    policy: torch.nn.Module,
    samplers: dict[str, Any],
    prompts: Callable[[int], PromptBatch],
    params: SamplingParams,
    seed: int,
    policy_steps: int,
) -> list[dict[str, Any]]:
    """Every draft rolls out round ``r``'s prompts with the same generator seed after taking the
    policy's current weights: one point per draft."""
    points = []
    for name, spec in samplers.items():
        spec.sync_weights(policy)
        ro = spec.generate(prompts(r), params, torch.Generator().manual_seed(seed + r))
        points.append(
            dict(
                round=r,
                policy_steps=policy_steps,
                draft=name,
                accepted_per_verify=ro.stats[ACCEPTED_PER_VERIFY],
                draft_accept_rate=ro.stats[DRAFT_ACCEPT_RATE],
            )
        )
    return points


def measure_drift(
    rounds: int = 4,
    drift_steps: int = 25,
    pretrain_steps: int = 400,
    text_batches: int = 150,
    warmup_rollouts: int = 4,
    prompts_per_round: int = 8,
    group_size: int = 4,
    draft_tokens: int = 5,
    temperature: float = 1.0,
    seed: int = 0,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the drift experiment (CPU, a few minutes). Returns ``{"task", "setup", "points"}``; each
    point has ``round``, ``draft`` (``ngram`` / ``eagle_frozen`` / ``eagle_online``), ``accepted_per_verify``,
    ``draft_accept_rate``."""
    task_name, problem, eos, pad, policy, opt, pos = _drift_policy(seed, pretrain_steps, progress)
    params = SamplingParams(
        group_size=group_size,
        max_new_tokens=48,
        temperature=temperature,
        eos_token_ids=(eos,),
        pad_token_id=pad,
    )
    eval_offset = 10_000_000  # prompts never trained on

    def prompts(r: int) -> PromptBatch:
        return PromptBatch.from_lists(
            [problem(eval_offset + r * 1000 + i)[0] for i in range(prompts_per_round)], pad
        )

    online, frozen = _drift_heads(
        policy, problem, pad, prompts, params, text_batches, warmup_rollouts, seed, progress
    )
    samplers = _drift_samplers(policy, online, frozen, draft_tokens)
    points: list[dict[str, Any]] = []
    for r in range(rounds + 1):
        if r > 0:
            pos = sft_steps(policy, opt, problem, pos, drift_steps, 32, pad)
        points += _drift_round(r, policy, samplers, prompts, params, seed, pretrain_steps + r * drift_steps)
        progress(
            f"drift round {r}: "
            + ", ".join(f"{p['draft']} {p['accepted_per_verify']:.2f}" for p in points[-len(samplers) :])
        )
    if not points:
        raise GRPOPartsError("rounds: expected >= 0")
    setup = dict(
        policy="qwen2 tiny_causal_lm hidden=128 layers=4",
        pretrain_steps=pretrain_steps,
        head_text_batches=text_batches,
        head_warmup_rollouts=warmup_rollouts,
        drift_steps_per_round=drift_steps,
        draft_tokens=draft_tokens,
        temperature=temperature,
        rows_per_round=prompts_per_round * group_size,
    )
    return {"task": task_name, "setup": setup, "points": points}


# ------------------------------------------------------------------------- bench policy on a task


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rounds", type=int, default=4, help="rounds of policy drift measured (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    drift = measure_drift(rounds=args.rounds, seed=args.seed)
    print(f"acceptance under policy drift ({drift['task']}):")
    for pt in drift["points"]:
        print(f"round {pt['round']} {pt['draft']:>13s} accepted/verify {pt['accepted_per_verify']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(drift, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
