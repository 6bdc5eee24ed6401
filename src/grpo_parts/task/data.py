"""Problems, what the built-in tasks share, turning problems into token batches and completions back
into text (any transformers tokenizer), plus held-out evaluation.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import GRPOPartsError
from ..sampler.protocol import PromptBatch, SamplingParams
from ..types import Rollout, VisionInputs
from .graders import after_delimiter

#: consecutive draws without a new held-out problem after which the pool counts as exhausted
#: (a remaining problem of a pool of N is missed that often with probability ~exp(-100_000 / N))
_EXHAUSTED_AFTER = 100_000


@dataclass(frozen=True)
class Problem:
    """A prompt (as the tokenizer sees it) and its gold final answer; ``columns``: the data row it came
    from and ``messages``: its chat prompt, for reward functions; ``images``: the images its prompt's
    placeholders stand for, in order, as the policy's processor takes them (none of these compared)."""

    prompt: str
    answer: str
    columns: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    messages: list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)
    images: tuple[Any, ...] = field(default=(), compare=False, repr=False)


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


class GeneratedTask:
    """What the built-in tasks share: problems generated from ``(seed, position)`` alone (the stream
    resumes at any position), a fixed ``config.eval_percent`` of all problems (by a hash of the
    prompt) held out and never trained on, the answer graded after the last ``;`` (exact match)."""

    grader_name = "after_delimiter ';'"
    config: Any

    def is_held_out(self, prompt: str) -> bool:
        return zlib.crc32(prompt.encode()) % 100 < self.config.eval_percent

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if after_delimiter(completion, ";") == problem.answer else 0.0

    def first_trained(self, rng: random.Random, draw: Callable[[random.Random], Problem]) -> Problem:
        """The first problem ``draw(rng)`` proposes that is not held out."""
        while True:
            p = draw(rng)
            if not self.is_held_out(p.prompt):
                return p

    def held_out(self, draw: Callable[[int], Problem]) -> list[Problem]:
        """``config.num_eval`` distinct held-out problems, ``draw(i)`` proposing a candidate for the i-th;
        asking a small task for more than it has is a config error said in one line, not an endless loop."""
        out: list[Problem] = []
        seen: set[str] = set()
        misses = 0
        while len(out) < self.config.num_eval:
            p = draw(len(out))
            if self.is_held_out(p.prompt) and p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
                misses = 0
                continue
            misses += 1
            if misses >= _EXHAUSTED_AFTER:
                raise GRPOPartsError(
                    f"task.num_eval: got {self.config.num_eval}, but these task settings have only about "
                    f"{len(out)} distinct held-out problems; expected <= {len(out)} (or a larger "
                    "task.eval_percent / larger problems)"
                )
        return out


def completion_ids(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids (masked tokens dropped), as TRL passes them to reward functions."""
    return [
        [t for t, k in zip(ids, m) if k]
        for ids, m in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist())
    ]


def text_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer itself, or a vision-language processor's tokenizer (what encodes its text)."""
    return getattr(tokenizer, "tokenizer", tokenizer)


def encode_prompts(tokenizer: Any, prompts: Sequence[str]) -> PromptBatch:
    """Tokenize and left-pad ``prompts`` (the tokenizer's own special tokens included, e.g. BOS)."""
    ids = [list(tokenizer(p).input_ids) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return PromptBatch.from_lists(ids, pad_token_id=int(pad))


def encode_problems(tokenizer: Any, problems: Sequence[Problem]) -> PromptBatch:
    """The problems' prompts as :func:`encode_prompts` makes them; when any has images, ``tokenizer``
    is the policy's processor (``processor(text=..., images=...)`` expands each placeholder) and each
    prompt's images ride along once in ``PromptBatch.vision``."""
    if not any(p.images for p in problems):
        return encode_prompts(text_tokenizer(tokenizer), [p.prompt for p in problems])
    images = [image for p in problems for image in p.images]
    out = tokenizer(text=[p.prompt for p in problems], images=images, padding=True, return_tensors="pt")
    vision = VisionInputs.from_processor(out, [len(p.images) for p in problems])
    return PromptBatch(out["input_ids"], out["attention_mask"], vision)


def decode_completions(tokenizer: Any, rollout: Rollout) -> list[str]:
    """The text of every completion (masked tokens and special tokens such as EOS dropped)."""
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids(rollout)]


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
    ``record`` receives each ``(completion, problem, reward)``. ``tokenizer``: the policy's processor
    when the problems have images (:func:`encode_problems`)."""
    one = params.model_copy(update={"group_size": 1})
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start : start + batch_size])
        rollout = sampler.generate(encode_problems(tokenizer, chunk), one)
        texts = decode_completions(tokenizer, rollout)
        rewards = [task.reward(t, p) for t, p in zip(texts, chunk)]
        correct += sum(rewards)
        if record is not None:
            record.extend(zip(texts, chunk, rewards))
    return correct / max(1, len(problems))
