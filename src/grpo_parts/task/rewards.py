"""Reward functions with TRL's signature, ``--reward module:function[@weight]``, called as TRL's
``GRPOTrainer`` calls them: ``fn(prompts=..., completions=..., completion_ids=..., trainer_state=...,
log_extra=..., log_metric=..., **columns) -> list[float | None]`` (the arguments and the weighted sum:
docs/training.md, "Reward functions"). An import failure or a signature that cannot take these
arguments is a one-line error before the run starts; a wrong return value, one naming the function.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..errors import GRPOPartsError
from .data import Problem

log = logging.getLogger("grpo_parts.train")

SIGNATURE = "def fn(completions, **kwargs) -> list[float]"


@dataclass
class RewardFunction:
    spec: str
    fn: Callable[..., Any]
    weight: float

    @property
    def name(self) -> str:
        return str(getattr(self.fn, "__name__", self.spec.rsplit(":", 1)[1]))


def _import(module: str, spec: str) -> Any:
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise GRPOPartsError(f"reward: {spec!r}: no such file {module!r}")
        loader = importlib.util.spec_from_file_location(f"grpo_parts_reward_{path.stem}", path)
        assert loader is not None and loader.loader is not None
        mod = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(mod)
        return mod
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # `grpo-parts` runs as a script: the working directory is not on it
    return importlib.import_module(module)


def load_reward(spec: str, weight: float, columns: Sequence[str]) -> RewardFunction:
    """Import ``module:function`` and check that it takes TRL's reward arguments (one-line errors)."""
    module, _, name = spec.rpartition(":")
    try:
        mod = _import(module, spec)
    except GRPOPartsError:
        raise
    except Exception as e:  # ImportError, or whatever the module raises while it is imported
        raise GRPOPartsError(
            f"reward: cannot import {module!r} for {spec!r}: {type(e).__name__}: {e}".splitlines()[0]
        ) from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise GRPOPartsError(f"reward: {spec!r}: module {module!r} has no function {name!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return RewardFunction(spec, fn, weight)  # a builtin: nothing to check
    args = dict.fromkeys(
        ["prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"]
    )
    args.update(dict.fromkeys(columns))
    try:
        sig.bind(**args)
    except TypeError as e:
        raise GRPOPartsError(
            f"reward: {spec}{sig} cannot take TRL's reward arguments (prompts, completions, completion_ids, "
            f"trainer_state, the data columns {sorted(columns)}): {e}; expected {SIGNATURE}"
        ) from None
    return RewardFunction(spec, fn, weight)


def _call(rf: RewardFunction, kwargs: dict[str, Any], n: int) -> list[float]:
    try:
        out = rf.fn(**kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(out)  # type: ignore[arg-type]
    except Exception as e:
        raise GRPOPartsError(f"reward: {rf.spec} raised {type(e).__name__}: {e}".splitlines()[0]) from None
    try:
        values = [math.nan if v is None else float(v) for v in out]
    except (TypeError, ValueError):
        values = []
    if len(values) != n:
        raise GRPOPartsError(
            f"reward: {rf.spec} returned {str(out)[:80]!r}; expected a list of {n} floats (or None), one per completion"
        )
    return values


class RewardedTask:
    """A task whose training reward is the weighted sum of reward functions (held-out accuracy, the
    ``accuracy`` metric and the flat-reward warning keep the task's grader)."""

    def __init__(self, task: Any, functions: list[RewardFunction], steps: int):
        self.task, self.functions, self.steps = task, functions, steps
        self.name = task.name
        self.grader_name = "reward functions " + ", ".join(f"{f.spec}@{f.weight:g}" for f in functions)
        self.last_per_function: dict[str, float] = {}

    def train_problem(self, index: int) -> Problem:
        return self.task.train_problem(index)  # type: ignore[no-any-return]

    def eval_problems(self) -> list[Problem]:
        return self.task.eval_problems()  # type: ignore[no-any-return]

    def reward(self, completion: str, problem: Problem) -> float:
        return float(self.task.reward(completion, problem))

    def batch_rewards(
        self, completions: list[str], problems: list[Problem], completion_ids: list[list[int]], step: int
    ) -> list[float]:
        """The weighted sum of the reward functions for each completion (TRL's nansum)."""
        n = len(completions)
        chat = all(p.messages is not None for p in problems)
        rows = [p.columns or {"answer": p.answer} for p in problems]
        keys = dict.fromkeys(k for row in rows for k in row)  # first-seen order
        columns = {k: [row.get(k) for row in rows] for k in keys}
        columns.pop("prompt", None)  # as TRL: passed as prompts
        kwargs = {
            "prompts": [p.messages for p in problems] if chat else [p.prompt for p in problems],
            "completions": [[{"role": "assistant", "content": c}] for c in completions]
            if chat
            else completions,
            "completion_ids": completion_ids,
            "trainer_state": SimpleNamespace(global_step=step, max_steps=self.steps),
            "log_extra": lambda *a, **k: None,
            "log_metric": lambda *a, **k: None,
            **columns,
        }
        per = [_call(rf, kwargs, n) for rf in self.functions]
        self.last_per_function = {rf.name: _nanmean(vals) for rf, vals in zip(self.functions, per)}
        return [
            sum(rf.weight * vals[i] for rf, vals in zip(self.functions, per) if not math.isnan(vals[i]))
            for i in range(n)
        ]


def _nanmean(values: list[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return sum(ok) / len(ok) if ok else math.nan


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """``"module:function@0.5"`` -> ``("module:function", 0.5)`` (weight 1 without ``@``)."""
    target, sep, w = spec.rpartition("@") if "@" in spec else (spec, "", "")
    module, colon, fn = target.rpartition(":")
    weight = None
    try:
        weight = float(w) if sep else 1.0
    except ValueError:
        pass
    if not colon or not module or not fn.isidentifier() or weight is None or not math.isfinite(weight):
        raise ValueError(
            f"rewards: got {spec!r}; expected 'module:function' or 'module:function@weight' "
            "(e.g. my_rewards:accuracy@0.5; module may be a path/to/file.py)"
        )
    return target, weight


def load_rewards(specs: Sequence[str], columns: Sequence[str]) -> list[RewardFunction]:
    return [load_reward(*parse_reward_spec(s), columns) for s in specs]
