"""Turning problems into token batches and completions back into text, plus held-out evaluation.

Works with any transformers tokenizer (the built-in character tokenizer is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class BatchRewards(Protocol):
    """A task whose training reward is computed for a whole batch at once (``--reward`` functions,
    TRL's signature: :class:`~grpo_parts.task.rewards.RewardedTask`); ``Task.reward`` then stays the
    grader (held-out accuracy, the ``accuracy`` metric)."""

    def batch_rewards(
        self, completions: list[str], problems: list[Problem], completion_ids: list[list[int]], step: int
    ) -> list[float]:
        """One reward per completion: ``completions[i]`` answers ``problems[i]``; ``completion_ids[i]``
        its token ids (padding dropped); ``step`` the training step (0-based)."""
        ...


@runtime_checkable
class ReportsRewardTerms(Protocol):
    """A task that reports the mean of each reward function over its last batch (logged as
    ``reward_<name>``)."""

    #: reward function name -> its mean over the last ``batch_rewards`` call (NaN: no value)
    last_per_function: dict[str, float]


def completion_ids(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids (masked tokens dropped), as TRL passes them to reward functions."""
    return [
        [t for t, k in zip(ids, m) if k]
        for ids, m in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist())
    ]


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
    record: list[tuple[str, Problem, float]] | None = None,
) -> float:
    """Fraction of ``problems`` answered correctly by one completion each (greedy if params say so);
    ``record`` receives each ``(completion, problem, reward)``."""
    one = params.model_copy(update={"group_size": 1})
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start : start + batch_size])
        rollout = sampler.generate(encode_prompts(tokenizer, [p.prompt for p in chunk]), one)
        texts = decode_completions(tokenizer, rollout)
        rewards = [task.reward(t, p) for t, p in zip(texts, chunk)]
        correct += sum(rewards)
        if record is not None:
            record.extend(zip(texts, chunk, rewards))
    return correct / max(1, len(problems))
