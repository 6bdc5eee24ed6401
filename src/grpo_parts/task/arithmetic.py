"""The built-in verifiable task: chain addition with a short worked solution (``17+25+9=`` ->
``17+25=42,42+9=51;51<eos>``).

Only the text after the last ``;`` is graded (exact match), so the worked part is the policy's own
business, as in real math RL. Completions are mostly copies plus one small addition per step: long
enough that rollout dominates a step, and copy-heavy, so speculative drafts have something to accept.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .data import GeneratedTask, Problem


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


class ArithmeticTask(GeneratedTask):
    """Chain addition. ``train_problem(i)`` is the i-th problem of the training stream."""

    name = "arithmetic"

    def __init__(self, config: ArithmeticConfig | None = None, seed: int = 0):
        self.config = config or ArithmeticConfig()
        self.seed = seed

    def _draw(self, rng: random.Random) -> list[int]:
        return [rng.randint(0, self.config.max_value) for _ in range(self.config.operands)]

    def problem(self, ops: list[int]) -> Problem:
        """The problem that adds ``ops`` (``"3+4="``, answer ``"7"``)."""
        return Problem("+".join(str(x) for x in ops) + "=", str(sum(ops)))

    def train_problem(self, index: int) -> Problem:
        # A counter-based stream: problem i depends only on (seed, i), so resuming is O(1).
        return self.first_trained(
            random.Random(f"train:{self.seed}:{index}"), lambda r: self.problem(self._draw(r))
        )

    def eval_problems(self) -> list[Problem]:
        """The held-out set: the same problems for every seed, so runs compare on equal terms."""
        rng = random.Random("eval")
        return self.held_out(lambda i: self.problem(self._draw(rng)))

    def sft_target(self, problem: Problem) -> str:
        return worked_solution([int(x) for x in problem.prompt.rstrip("=").split("+")])
