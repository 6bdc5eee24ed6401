"""A built-in task shaped like reasoning RL: a long shared instruction and long-tailed worked solutions.

Real GRPO prompts share an instruction, and real completions have long-tailed lengths, so the end of
every rollout runs at low concurrency. Here the solution *reduces* the sum one line at a time (add
the first two terms, copy the rest), so its length grows about quadratically with the terms, and
every ``long_every``-th problem is long: the tail of every rollout batch. Each line copies most of
the line before, so a draft that looks up the row's own text has a lot to accept in the tail. Shape
and lengths: docs/training.md, "The built-in tasks".
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .data import GeneratedTask, Problem

#: The fixed instruction every prompt starts with (one token per character with the task's tokenizer).
INSTRUCTION = "add the numbers. each line adds the first two terms and copies the rest. answer after ;. "
#: The characters of the task's tokenizer (specials come first; see :mod:`.tokenizer`).
CHARS = "0123456789+-*=,;: abcdefghijklmnopqrstuvwxyz."


class ReasoningConfig(BaseModel):
    """Size of the problems. ``long_every``: every that many positions of the stream is a long problem."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["reasoning"] = "reasoning"
    min_terms: int = Field(7, ge=2, le=64)
    max_terms: int = Field(7, ge=2, le=64)
    long_min_terms: int = Field(14, ge=2, le=64)
    long_max_terms: int = Field(14, ge=2, le=64)
    long_every: int = Field(8, ge=1, le=1000, description="1 = every problem is long")
    max_digit: int = Field(3, ge=1, le=9)
    labeled: bool = Field(True, description="each term carries a letter (a3+b5+...), copied with it")
    eval_percent: int = Field(10, ge=1, le=50)
    num_eval: int = Field(200, ge=1, le=100_000)
    train_size: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="a finite training set of this many problems, drawn epoch by epoch (each epoch a new "
        "order), as real GRPO data is (GSM8K 7.5k, MATH 7.5k); None: a fresh problem every draw",
    )

    @model_validator(mode="after")
    def _check(self) -> ReasoningConfig:
        if self.min_terms > self.max_terms or self.long_min_terms > self.long_max_terms:
            raise ValueError(
                f"terms: expected min <= max, got [{self.min_terms}, {self.max_terms}] and "
                f"[{self.long_min_terms}, {self.long_max_terms}]"
            )
        return self


def _term(i: int, x: int, labeled: bool) -> str:
    return f"{chr(97 + i)}{x}" if labeled else str(x)


def reduction_solution(terms: list[int], labeled: bool = False) -> str:
    """``[3, 5, 2, 7]`` -> ``"8+2+7=10+7=17;17"`` (labeled: ``"8+c2+d7=10+d7=17;17"``): add the
    first two terms, copy the rest, repeat."""
    lines, total = [], terms[0]
    for j in range(1, len(terms)):
        total += terms[j]
        rest = [_term(i, terms[i], labeled) for i in range(j + 1, len(terms))]
        lines.append("+".join([str(total), *rest]))
    return "=".join(lines) + f";{total}"


class ReasoningTask(GeneratedTask):
    """Reduction of a sum with a long-tailed number of terms behind a fixed instruction."""

    name = "reasoning"
    instruction = INSTRUCTION

    def __init__(self, config: ReasoningConfig | None = None, seed: int = 0):
        self.config = config or ReasoningConfig()
        self.seed = seed
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its order) with train_size

    def _draw(self, rng: random.Random, long: bool) -> list[int]:
        c = self.config
        lo, hi = (c.long_min_terms, c.long_max_terms) if long else (c.min_terms, c.max_terms)
        return [rng.randint(1, c.max_digit) for _ in range(rng.randint(lo, hi))]

    def problem(self, terms: list[int]) -> Problem:
        """The problem that adds ``terms`` (the prompt as the task writes it)."""
        body = "+".join(_term(i, x, self.config.labeled) for i, x in enumerate(terms))
        return Problem(self.instruction + body + "=", str(sum(terms)))

    def _is_long(self, index: int) -> bool:
        return index % self.config.long_every == self.config.long_every - 1

    def train_problem(self, index: int) -> Problem:
        """The ``index``-th problem of the training stream; with ``train_size``, the stream goes over
        the same ``train_size`` problems epoch after epoch, in a new order each epoch."""
        n = self.config.train_size
        if n is not None:
            epoch, pos = divmod(index, n)
            index = self._epoch_order(epoch)[pos]
        long = self._is_long(index)
        return self.first_trained(
            random.Random(f"reasoning:{self.seed}:{index}"), lambda r: self.problem(self._draw(r, long))
        )

    def _epoch_order(self, epoch: int) -> list[int]:
        """The problems' order in ``epoch`` (the last one kept: the stream reads epochs in turn)."""
        if self._order[0] != epoch:
            order = list(range(self.config.train_size or 0))
            random.Random(f"reasoning-epoch:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def eval_problems(self) -> list[Problem]:
        """The held-out set (the same for every seed), with the stream's share of long problems."""
        rng = random.Random("reasoning:eval")
        return self.held_out(lambda i: self.problem(self._draw(rng, self._is_long(i))))

    def terms(self, problem: Problem) -> list[int]:
        body = problem.prompt[len(self.instruction) :].rstrip("=")
        return [int(x.lstrip("abcdefghijklmnopqrstuvwxyz")) for x in body.split("+")]

    def sft_target(self, problem: Problem) -> str:
        return reduction_solution(self.terms(problem), self.config.labeled)
