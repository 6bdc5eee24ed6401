"""Seeing what is learnt: ``samples.jsonl`` and the flat-reward check: a step whose rewards are all
equal teaches nothing (every advantage is zero), and after ``stop_after_flat`` such steps in a row the
run stops (docs/training.md, "Seeing what is learnt")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ...task.data import Problem
from ..config import TrainConfig
from .metrics import MetricsWriter

log = logging.getLogger("grpo_parts.train")

Sample = tuple[str, Problem, float]


def sample_rows(step: int, split: str, samples: list[Sample], n: int) -> list[dict[str, Any]]:
    return [
        {"step": step, "split": split, "prompt": p.prompt, "answer": p.answer, "completion": c, "reward": r}
        for c, p, r in samples[:n]
    ]


class SampleLog:
    """``samples.jsonl`` of a run folder (rows after ``keep_up_to_step`` dropped on resume), and the
    count of flat steps in a row."""

    def __init__(self, path: Path, config: TrainConfig, keep_up_to_step: int | None = None):
        self.writer = MetricsWriter(path, keep_up_to_step=keep_up_to_step)
        self.n, self.stop_after = config.samples_per_eval, config.stop_after_flat
        self.flat_steps: list[int] = []
        self.last_eval: list[dict[str, Any]] = []

    def write(self, step: int, evals: list[Sample], train: list[Sample]) -> None:
        rows = sample_rows(step, "eval", evals, self.n) + sample_rows(step, "train", train, self.n)
        self.last_eval = rows[: min(3, self.n)]
        for row in rows:
            self.writer.write(row)

    def check_flat(self, step: int, samples: list[Sample], grader: str) -> str | None:
        """Warn about a step whose rewards are all equal; the stop message once there were
        ``stop_after_flat`` of them in a row (None otherwise)."""
        rewards = {r for _, _, r in samples}
        if len(rewards) != 1:
            self.flat_steps = []
            return None
        value = rewards.pop()
        self.flat_steps.append(step)
        completion, problem, _ = samples[0]
        log.warning(
            "step %d: every reward is %g (grader: %s), so no advantage and nothing to learn; e.g. completion "
            "%r for answer %r",
            step, value, grader, completion[-200:], problem.answer,
        )  # fmt: skip
        if not self.stop_after or len(self.flat_steps) < self.stop_after:
            return None
        return (
            f"rewards: every reward of steps {self.flat_steps[0]}-{step} is {value:g} (grader: {grader}), "
            f"{len(self.flat_steps)} steps in a row (stop_after_flat: {self.stop_after}), so nothing is learnt; "
            f"e.g. completion {completion[-80:]!r} for answer {problem.answer!r}; check the grader "
            "(--set task.grader=..., samples.jsonl) and start again, or carry on"
        )

    def close(self) -> None:
        self.writer.close()
