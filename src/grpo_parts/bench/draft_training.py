"""Draft construction and warm-up for ``grpo-parts bench sampler``, and the task policy and text
batches it trains on (:mod:`grpo_parts.task`; also used by scripts/measure/draft_drift.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..decoding import SamplingParams
from ..draft.protocol import DraftModel, DraftTrainingBatch
from ..sampler.stats import ACCEPTED_PER_VERIFY
from ..types import PromptBatch


def make_draft(name: str, policy: torch.nn.Module, seed: int = 0) -> DraftModel:
    """A draft by registry name with bench defaults (``frozen_lm`` / ``small_lm``: a random 1-layer LM, half width)."""
    from ..draft import get_draft_class

    cls = get_draft_class(name)
    if name in ("frozen_lm", "small_lm"):
        from ..tiny import tiny_causal_lm

        cfg: Any = policy.config
        h = max(32, int(cfg.hidden_size) // 2)
        small = tiny_causal_lm(
            "qwen2", vocab_size=int(cfg.vocab_size), hidden_size=h, num_layers=1, num_heads=max(1, h // 64),
            intermediate_size=2 * h, dtype=next(policy.parameters()).dtype, seed=seed + 1,
        )  # fmt: skip
        return cls(small.to(next(policy.parameters()).device))  # type: ignore[no-any-return]
    if name == "eagle":
        from ..draft.eagle import EagleConfig

        # the settings of the drift experiment: a higher lr and a full-weight distribution loss
        # (acceptance is 1 - TV(p, q), so matching the distribution matters more than the feature)
        return cls(policy, EagleConfig(lr=3e-3, ce_weight=1.0, seed=seed))  # type: ignore[no-any-return]
    return cls()  # type: ignore[no-any-return]


def distill_on_text(
    draft: DraftModel, policy: torch.nn.Module, batches: int, batch_size: int = 32, seed: int = 0
) -> list[float]:
    """Distil a learnable ``draft`` offline on ``batches`` batches of built-in task text (teacher-forced
    policy features and logits), as EAGLE heads are trained before deployment. Returns the losses."""
    if not draft.learnable or batches <= 0:
        return []
    _, problem, _, _, pad = task_data(seed)
    return [
        float(draft.update(text_batch(policy, problem, 5_000_000 + batch_size * i, batch_size, pad))["loss"])
        for i in range(batches)
    ]


def warm_up(
    draft: DraftModel,
    policy: torch.nn.Module,
    prompts: PromptBatch | Callable[[int], PromptBatch],
    params: SamplingParams,
    rounds: int,
    seed: int = 0,
) -> list[float]:
    """Distil a learnable ``draft`` from ``rounds`` rollouts of ``policy``; returns accepted/verify per round."""
    from ..sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler

    if not draft.learnable or rounds <= 0:
        return []
    spec = SpeculativeSampler(policy, draft, SpeculativeConfig(draft_tokens=4, train_draft=True))
    out = []
    for r in range(rounds):
        batch = prompts(r) if callable(prompts) else prompts
        ro = spec.generate(batch, params, torch.Generator().manual_seed(seed + r))
        out.append(ro.stats[ACCEPTED_PER_VERIFY])
    return out


# ---------------------------------------------------------------------------------------- tasks
def task_data(seed: int) -> tuple[str, Callable[[int], tuple[list[int], list[int]]], int, int, int]:
    """``(name, problem(i) -> (prompt_ids, target_ids), vocab, eos, pad)`` of the built-in chain
    addition task."""
    from ..task.arithmetic import ArithmeticConfig, ArithmeticTask
    from ..task.tokenizer import EOS_ID, PAD_ID, build_hf_tokenizer

    tok = build_hf_tokenizer()
    task = ArithmeticTask(ArithmeticConfig(), seed=seed)

    def problem(i: int) -> tuple[list[int], list[int]]:
        p = task.train_problem(i)
        return tok.encode(p.prompt), tok.encode(task.sft_target(p)) + [EOS_ID]

    return "built-in chain addition (grpo_parts.task)", problem, len(tok), EOS_ID, PAD_ID


def padded_rows(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, ...]:
    """``(ids, labels, mask): [R, W]`` of ``(prompt, target)`` rows back to back, right-padded:
    ``labels`` the target tokens (-100 elsewhere), ``mask`` 1 on real tokens."""
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (a, b) in enumerate(rows):
        ids[i, : len(a) + len(b)] = torch.tensor(a + b)
        labels[i, len(a) : len(a) + len(b)] = torch.tensor(b)
        mask[i, : len(a) + len(b)] = 1
    return ids, labels, mask


def sft_steps(
    policy: torch.nn.Module, opt: torch.optim.Optimizer, problem: Callable[[int], tuple[list[int], list[int]]],
    start: int, steps: int, batch: int, pad: int,
) -> int:  # fmt: skip
    policy.train()
    for _ in range(steps):
        ids, labels, mask = padded_rows([problem(start + i) for i in range(batch)], pad)
        start += batch
        loss = policy(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.eval()
    return start


def text_batch(
    policy: torch.nn.Module,
    problem: Callable[[int], tuple[list[int], list[int]]],
    start: int,
    n: int,
    pad: int,
) -> DraftTrainingBatch:
    """Teacher-forced policy features and logits on ``n`` task texts (prompt + worked solution)."""
    ids, labels, attn = padded_rows([problem(start + i) for i in range(n)], pad)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, :-1] = (labels[:, 1:] != -100).long()  # positions whose next token is the target's
    with torch.no_grad():
        out = policy(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    return DraftTrainingBatch(ids, loss_mask, out.hidden_states[-1], out.logits, attn)


def task_policy(
    hidden: int,
    layers: int,
    steps: int,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    batch: int = 16,
) -> tuple[torch.nn.Module, Callable[[int], list[int]], int, int, str]:
    """A qwen2 policy of the given size trained ``steps`` SFT steps on the task (so its next-token
    distributions are as peaked as a trained LM's, unlike a random one). Returns
    ``(policy, prompt(i) -> ids, eos, pad, task name)``."""
    from ..tiny import tiny_causal_lm

    torch.manual_seed(seed)
    task_name, problem, vocab, eos, pad = task_data(seed)
    heads = max(1, hidden // 64)
    policy = tiny_causal_lm(
        "qwen2", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=max(1, heads // 2), intermediate_size=4 * hidden, seed=seed, eos_token_id=eos, pad_token_id=pad,
    )  # fmt: skip
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    sft_steps(policy, opt, problem, 0, steps, batch, pad)
    progress(f"policy: {steps} SFT steps (batch {batch}) on {task_name} ({time.perf_counter() - t0:.0f}s)")

    def prompt(i: int) -> list[int]:
        return problem(10_000_000 + i)[0]

    return policy, prompt, eos, pad, task_name
