"""Turning problems into token batches and completions back into text, plus held-out evaluation.

Works with any transformers tokenizer (the built-in character tokenizer is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..sampler.protocol import PromptBatch, SamplingParams
from ..types import Rollout
from .arithmetic import Problem


class Task(Protocol):
    """What the training loop needs from a task."""

    name: str

    def train_problem(self, index: int) -> Problem: ...

    def eval_problems(self) -> list[Problem]: ...

    def reward(self, completion: str, problem: Problem) -> float: ...


def encode_prompts(tokenizer: Any, prompts: Sequence[str]) -> PromptBatch:
    """Tokenize and left-pad ``prompts`` (the tokenizer's own special tokens included, e.g. BOS)."""
    ids = [list(tokenizer(p).input_ids) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return PromptBatch.from_lists(ids, pad_token_id=int(pad))


def decode_completions(tokenizer: Any, rollout: Rollout) -> list[str]:
    """The text of every completion (masked tokens and special tokens such as EOS dropped)."""
    out = []
    for ids, m in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist()):
        out.append(tokenizer.decode([t for t, k in zip(ids, m) if k], skip_special_tokens=True))
    return out


@torch.no_grad()
def eval_accuracy(
    sampler: Any,
    task: Task,
    problems: Sequence[Problem],
    tokenizer: Any,
    params: SamplingParams,
    batch_size: int = 256,
) -> float:
    """Fraction of ``problems`` answered correctly by one completion each (greedy if params say so)."""
    one = params.model_copy(update={"group_size": 1})
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start : start + batch_size])
        rollout = sampler.generate(encode_prompts(tokenizer, [p.prompt for p in chunk]), one)
        texts = decode_completions(tokenizer, rollout)
        correct += sum(task.reward(t, p) for t, p in zip(texts, chunk))
    return correct / max(1, len(problems))
