"""The built-in verifiable task: chain addition with a short worked solution.

A prompt adds ``operands`` numbers in ``[0, max_value]``; the policy writes the running sums and then
the answer after ``;``::

    prompt:      17+25+9=
    completion:  17+25=42,42+9=51;51<eos>

Only the text after the last ``;`` is graded (exact match), so the worked part is the policy's own
business -- as in real math RL, where only the boxed answer is checked. Completions are mostly
copies (operands from the prompt, partial sums from the line before) plus one small addition per
step: long enough that rollout dominates a step, and copy-heavy, so speculative drafts (n-gram,
online) have something to accept, as they do on real reasoning traces.

Problems are generated from ``(seed, position)`` alone, so the stream can resume at any position.
A fixed ~10% of all problems (by a hash of the prompt) is held out for evaluation and never trained on.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import GRPOPartsError

#: consecutive draws without a new held-out problem after which the pool counts as exhausted
#: (a remaining problem of a pool of N is missed that often with probability ~exp(-100_000 / N))
_EXHAUSTED_AFTER = 100_000


@dataclass(frozen=True)
class Problem:
    """A prompt (as the tokenizer sees it) and its gold final answer; ``columns``: the data row it came
    from and ``messages``: its chat prompt, for reward functions (not compared)."""

    prompt: str
    answer: str
    columns: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    messages: list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)


class ArithmeticConfig(BaseModel):
    """Size of the built-in problems. ``eval_percent`` of all problems are held out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["arithmetic"] = "arithmetic"
    operands: int = Field(3, ge=2, le=6)
    max_value: int = Field(99, ge=1, le=9999)
    eval_percent: int = Field(10, ge=1, le=50)
    num_eval: int = Field(200, ge=1, le=100_000)


def worked_solution(operands: list[int]) -> str:
    """The completion the warm start is taught: running sums, then ``;answer``."""
    steps, total = [], operands[0]
    for x in operands[1:]:
        steps.append(f"{total}+{x}={total + x}")
        total += x
    return ",".join(steps) + f";{total}"


def extract_answer(completion: str) -> str | None:
    """The text after the last ``;`` (stripped), or None when there is none."""
    if ";" not in completion:
        return None
    return completion.rsplit(";", 1)[1].strip()


def collect_held_out(
    draw: Callable[[int], Problem], is_held_out: Callable[[str], bool], num_eval: int
) -> list[Problem]:
    """``num_eval`` distinct held-out problems, ``draw(i)`` proposing a candidate for the i-th.

    A small task (few terms, small digits) has few distinct held-out problems; asking for more is a
    config error, said in one line, instead of a loop that never ends.
    """
    out: list[Problem] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < num_eval:
        p = draw(len(out))
        if is_held_out(p.prompt) and p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
            misses = 0
            continue
        misses += 1
        if misses >= _EXHAUSTED_AFTER:
            raise GRPOPartsError(
                f"task.num_eval: got {num_eval}, but these task settings have only about {len(out)} distinct "
                f"held-out problems; expected <= {len(out)} (or a larger task.eval_percent / larger problems)"
            )
    return out


class ArithmeticTask:
    """Chain addition. ``train_problem(i)`` is the i-th problem of the training stream."""

    name = "arithmetic"
    grader_name = "after_delimiter ';'"

    def __init__(self, config: ArithmeticConfig | None = None, seed: int = 0):
        self.config = config or ArithmeticConfig()
        self.seed = seed

    def _draw(self, rng: random.Random) -> list[int]:
        return [rng.randint(0, self.config.max_value) for _ in range(self.config.operands)]

    def is_held_out(self, prompt: str) -> bool:
        return zlib.crc32(prompt.encode()) % 100 < self.config.eval_percent

    def problem(self, ops: list[int]) -> Problem:
        """The problem that adds ``ops`` (``"3+4="``, answer ``"7"``)."""
        return Problem("+".join(str(x) for x in ops) + "=", str(sum(ops)))

    def train_problem(self, index: int) -> Problem:
        # A counter-based stream: problem i depends only on (seed, i), so resuming is O(1).
        rng = random.Random(f"train:{self.seed}:{index}")
        while True:
            p = self.problem(self._draw(rng))
            if not self.is_held_out(p.prompt):
                return p

    def eval_problems(self) -> list[Problem]:
        """The held-out set: the same problems for every seed, so runs compare on equal terms."""
        rng = random.Random("eval")
        return collect_held_out(
            lambda i: self.problem(self._draw(rng)), self.is_held_out, self.config.num_eval
        )

    def sft_target(self, problem: Problem) -> str:
        return worked_solution([int(x) for x in problem.prompt.rstrip("=").split("+")])

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if extract_answer(completion) == problem.answer else 0.0
