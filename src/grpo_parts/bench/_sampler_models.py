"""The policies, prompts and drafts ``grpo-parts bench sampler`` measures (a random qwen2, or one SFT-trained
on the built-in task with a small LM draft) and transformers ``generate`` as a sampler. Trained weights
are cached (``--cache-dir``) as plain state dicts, read back with ``weights_only=True``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GRPOPartsError
from ..sampler.protocol import PromptBatch, Rollout, SamplingParams
from ..sampler.reference import completion_mask_from_eos, expand_prompts


class GenerateSampler:
    """transformers ``model.generate`` behind the ``Sampler.generate`` signature (the yardstick); its
    ``logprobs`` are zeros (not computed), which only favours ``generate``."""

    name = "generate"

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.inference_mode()
    def generate(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        device = next(self.model.parameters()).device
        ids, mask, group = expand_prompts(prompts, params.group_size)
        ids, mask = ids.to(device), mask.to(device)
        kw: dict[str, Any] = dict(do_sample=False)
        if not params.greedy:
            kw = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        out = self.model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0 if params.eos_token_ids else params.max_new_tokens,
            eos_token_id=list(params.eos_token_ids) or None,
            pad_token_id=params.pad_token_id,
            **kw,
        )
        completion = out[:, ids.shape[1] :]
        cmask = completion_mask_from_eos(completion, params.eos_token_ids)
        return Rollout(
            ids, mask, completion, cmask, torch.zeros(completion.shape), group.to(device), prompts.num_prompts
        )


@dataclass(frozen=True)
class BenchTask:
    """What ``--policy task`` brings besides the model: the task's name, its prompt for a seed, and its
    EOS and pad ids (``make_policy`` sets it as ``args.bench_task``)."""

    name: str
    prompt: Callable[[int], list[int]]
    eos: int
    pad: int


def make_policy(args: argparse.Namespace) -> torch.nn.Module:
    from ..tiny import tiny_causal_lm

    if args.policy == "task":
        from .draft_training import task_policy

        key = f"policy_{policy_key(args)}"
        state = cache_load(args, key)
        policy, prompt, eos, pad, task = task_policy(
            args.hidden, args.layers, 0 if state is not None else args.task_steps, args.seed
        )
        args.bench_task = BenchTask(task, prompt, eos, pad)
        if state is not None:
            policy.load_state_dict(state)
            print(f"policy: loaded from the bench cache ({key})")
        else:
            cache_save(args, key, policy.state_dict())
        args.vocab = int(getattr(policy, "config").vocab_size)  # noqa: B009
        return policy.eval()

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    heads = max(1, args.hidden // 64)
    model = tiny_causal_lm(
        "qwen2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
        num_kv_heads=max(1, heads // 2), intermediate_size=4 * args.hidden, dtype=getattr(torch, dtype),
        seed=args.seed,
    )  # fmt: skip
    return model.to(device)


def task_draft(policy: torch.nn.Module, args: argparse.Namespace, name: str) -> Any:
    from ..draft import get_draft_class
    from .draft_training import task_policy

    hidden = max(32, args.hidden // 2)
    key = f"frozen_lm_{policy_key(args)}"
    state = cache_load(args, key)
    small = task_policy(hidden, 2, 0 if state is not None else args.task_steps, args.seed)[0]
    if state is not None:
        small.load_state_dict(state)
    else:
        cache_save(args, key, small.state_dict())
    return get_draft_class(name)(small.eval())


def eos_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``SamplingParams`` keywords for the bench's policy: the task's EOS and pad ids (``--policy
    task``, set on ``args`` by ``make_policy``), none for a random policy."""
    if args.policy != "task":
        return {}
    task: BenchTask = args.bench_task
    return dict(eos_token_ids=(task.eos,), pad_token_id=task.pad)


def bench_prompts(args: argparse.Namespace, batch: int, group_size: int, seed: int) -> PromptBatch:
    """The bench's ``batch // group_size`` prompts for ``seed``: task prompts (``--policy task``) or
    random token prompts of 50-100% of ``--prompt-len``."""
    if batch % group_size:
        raise GRPOPartsError(f"--batches: expected multiples of --group-size={group_size}, got {batch}")
    n = batch // group_size
    if args.policy == "task":
        task: BenchTask = args.bench_task
        return PromptBatch.from_lists([task.prompt(seed * 100_000 + i) for i in range(n)], task.pad)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (n,), generator=g).tolist()
    return PromptBatch.from_lists([torch.randint(1, args.vocab, (k,), generator=g).tolist() for k in lens], 0)


def policy_key(args: argparse.Namespace) -> str:
    return f"h{args.hidden}_l{args.layers}_steps{args.task_steps}_seed{args.seed}"


def cache_load(args: argparse.Namespace, key: str) -> Any:
    import os

    if not args.cache_dir:
        return None
    path = os.path.join(os.path.expanduser(args.cache_dir), key + ".pt")
    return torch.load(path, weights_only=True) if os.path.isfile(path) else None


def cache_save(args: argparse.Namespace, key: str, state: Any) -> None:
    import os

    if args.cache_dir:
        folder = os.path.expanduser(args.cache_dir)
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, key + ".pt"))
