"""``history``: skip prompts whose recent groups all had zero reward variance, GRESO-style
(arXiv 2506.02177), and weight the prompts kept by ``1 / p`` so that skipping leaves the expected
gradient unchanged (GRESO drops them unweighted, which biases the gradient towards those it keeps).

Each drawn prompt gets an inclusion probability ``p`` from its zero-variance streak (``rule="streak"``:
``max(min_keep_prob, keep_base ** z)``) or from a Beta posterior over its pass rate
(``rule="posterior"``, :func:`zero_variance_probability`); prompts are drawn by
:func:`grpo_parts.core.inclusion.systematic_sample`. The rule, the adaptation of ``keep_base``, what
is remembered per prompt, ``step_size`` and ``min_rollout_share``, and the proof of the ``1 / p``
normaliser: docs/filter.md, "Skipping prompts before rollout".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ..core.inclusion import probabilities_for_target, systematic_sample
from ..errors import GRPOPartsError, check_tensor
from .protocol import PromptId, SkipDecision

__all__ = ["HistorySkipper", "PromptRecord", "zero_variance_probability"]


@dataclass
class PromptRecord:
    """What one prompt's history holds: ``flags`` (zero-variance, most recent last), the last group's
    reward ``variance`` and ``mean_reward``, the mean completion ``length`` (NaN: unknown), ``seen``."""

    flags: list[bool] = field(default_factory=list)
    variance: float = 0.0
    mean_reward: float = 0.0
    length: float = math.nan
    seen: int = 0
    #: ``rule="posterior"``: discounted pass count and rollouts (each older group weighs
    #: ``1 - 1 / window`` less) and the last group's size
    passes: float = 0.0
    trials: float = 0.0
    group: int = 0

    @property
    def streak(self) -> int:
        """Zero-variance groups in a row, most recent first."""
        return next((i for i, f in enumerate(reversed(self.flags)) if not f), len(self.flags))


class HistorySkipper(BaseModel):
    """Skip prompts with a zero-variance streak (see the module docstring), weights ``1 / p``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: ClassVar[str] = "history"

    min_keep_prob: float = Field(0.1, gt=0.0, le=1.0, description="floor on a prompt's inclusion probability")
    min_streak: int = Field(
        1, ge=1, description="zero-variance groups in a row before a prompt may be skipped"
    )
    window: int = Field(8, ge=1, le=64, description="recent groups remembered per prompt")
    keep_base: float = Field(0.5, gt=0.0, lt=1.0, description="initial exploration base p_e (GRESO: 0.5)")
    min_base: float = Field(0.05, gt=0.0, lt=1.0)
    max_base: float = Field(0.95, gt=0.0, lt=1.0)
    base_step: float = Field(0.01, ge=0.0, lt=1.0, description="change of keep_base per observe (0: fixed)")
    target: Literal["zero_variance", "skip"] = "zero_variance"
    rule: Literal["streak", "posterior"] = Field(
        "streak", description="streak: keep_base ** z (GRESO); posterior: 1 - P(next group zero-variance)"
    )
    step_size: Literal["fill", "fewer"] = Field(
        "fill",
        description="fill: the step keeps its prompts by drawing more; fewer: it rolls out only the kept ones",
    )
    min_rollout_share: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="fewer: the least share of a step's drawn prompts rolled out (probabilities raised to it)",
    )
    target_share: float = Field(0.25, ge=0.0, le=1.0)
    capacity: int = Field(1_000_000, ge=1, description="prompts remembered at most")
    seed: int = Field(0, ge=0)
    _records: dict[PromptId, PromptRecord] = PrivateAttr(default_factory=dict)
    _base: float = PrivateAttr(0.5)
    _generator: torch.Generator = PrivateAttr()
    _pending: list[float] = PrivateAttr(default_factory=lambda: [0.0, 0.0])  # drawn, expected skipped
    _last_share: float = PrivateAttr(0.0)

    @model_validator(mode="after")
    def _check(self) -> HistorySkipper:
        if not self.min_base <= self.keep_base <= self.max_base:
            raise ValueError(
                f"keep_base: expected a value in [min_base, max_base] = [{self.min_base}, {self.max_base}], "
                f"got {self.keep_base}"
            )
        if self.min_rollout_share > 0.0 and self.step_size != "fewer":
            raise ValueError(
                f"min_rollout_share: a floor on the prompts a 'fewer' step rolls out, got {self.min_rollout_share} "
                f"with step_size={self.step_size!r} (expected 0, or step_size 'fewer')"
            )
        if self.min_streak > self.window:
            raise ValueError(
                f"min_streak: expected <= window={self.window} (groups remembered), got {self.min_streak}"
            )
        return self

    def model_post_init(self, context: Any, /) -> None:
        self._base = self.keep_base
        self._generator = torch.Generator().manual_seed(self.seed)

    @property
    def base(self) -> float:
        """The current exploration base ``p_e`` (adapted by :meth:`observe`)."""
        return self._base

    def record(self, prompt_id: PromptId) -> PromptRecord | None:
        return self._records.get(int(prompt_id))

    def inclusion_probability(self, prompt_id: PromptId) -> float:
        rec = self._records.get(int(prompt_id))
        z = 0 if rec is None else rec.streak
        if rec is None or z < self.min_streak:
            return 1.0
        if self.rule == "posterior":
            return max(self.min_keep_prob, 1.0 - zero_variance_probability(rec.passes, rec.trials, rec.group))
        return max(self.min_keep_prob, self._base**z)

    def decide(
        self,
        prompt_ids: Sequence[PromptId],
        generator: torch.Generator | None = None,
        target: float | None = None,
    ) -> SkipDecision:
        raw = torch.tensor([self.inclusion_probability(i) for i in prompt_ids], dtype=torch.float64)
        p = probabilities_for_target(raw, target, self.min_keep_prob)
        kept = systematic_sample(p, self._generator if generator is None else generator).nonzero().flatten()
        weights = 1.0 / p[kept]
        self._pending[0] += float(p.numel())
        self._pending[1] += float((1.0 - p).sum())
        info = {
            "drawn": float(p.numel()),
            "kept": float(kept.numel()),
            "expected_kept": float(p.sum()),
            "max_weight": float(weights.max()) if kept.numel() else 0.0,
        }
        return SkipDecision(kept, weights, p, info)

    def observe(
        self,
        prompt_ids: Sequence[PromptId],
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """Record each rolled-out group (zero variance: every reward of the group equal, by exact
        comparison; a group of one counts as zero-variance), then adapt ``keep_base`` once."""
        stats = _group_stats(len(prompt_ids), rewards, group_index, lengths)
        # a group without rows has min +inf and max -inf, which never trips the range check
        lo, hi = (float(stats[1].min()), float(stats[2].max())) if len(prompt_ids) else (0.0, 0.0)
        if self.rule == "posterior" and (lo < 0.0 or hi > 1.0):
            raise GRPOPartsError(
                f"rewards: rule='posterior' reads rewards in [0, 1] as pass rates, got [{lo:g}, {hi:g}]"
            )
        observed = zero = 0
        for g, pid in enumerate(prompt_ids):
            count, rmin, rmax, mean, var, length = (float(x[g]) for x in stats)
            if count == 0:
                continue
            observed += 1
            zero += int(rmin == rmax)
            self._remember(int(pid), rmin == rmax, var, mean, length, int(count))
        self._adapt(zero / observed if observed else 0.0)

    def _remember(self, pid: PromptId, zero: bool, var: float, mean: float, length: float, rows: int) -> None:
        rec = self._records.pop(pid, None) or PromptRecord()
        rec.flags = (rec.flags + [zero])[-self.window :]
        rec.variance, rec.mean_reward, rec.seen = var, mean, rec.seen + 1
        if not math.isnan(length):
            rec.length = length
        keep = 1.0 - 1.0 / self.window
        rec.passes, rec.trials, rec.group = keep * rec.passes + mean * rows, keep * rec.trials + rows, rows
        self._records[pid] = rec  # most recently observed last
        while len(self._records) > self.capacity:
            del self._records[next(iter(self._records))]

    def _adapt(self, zero_share: float) -> None:
        drawn, skipped = self._pending
        skip_share = skipped / drawn if drawn else 0.0
        self._last_share = zero_share if self.target == "zero_variance" else skip_share
        if self.base_step > 0:
            zero_target = self.target == "zero_variance"
            skip_more = zero_share >= self.target_share if zero_target else skip_share < self.target_share
            step = -self.base_step if skip_more else self.base_step
            self._base = min(self.max_base, max(self.min_base, self._base + step))
        self._pending = [0.0, 0.0]

    def history_stats(self) -> dict[str, float]:
        return {
            "history_size": float(len(self._records)),
            "keep_base": self._base,
            f"{self.target}_share": self._last_share,
        }

    def mean_completion_length(self, prompt_id: PromptId) -> float | None:
        rec = self._records.get(int(prompt_id))
        return None if rec is None or math.isnan(rec.length) else rec.length

    def state_dict(self) -> dict[str, Any]:
        """Tensors and floats only (``torch.load(weights_only=True)`` reads them)."""
        recs = list(self._records.items())
        flags = torch.full((len(recs), self.window), -1, dtype=torch.int8)
        for row, (_, rec) in enumerate(recs):
            if rec.flags:
                flags[row, self.window - len(rec.flags) :] = torch.tensor(rec.flags, dtype=torch.int8)
        floats = torch.tensor(
            [[r.variance, r.mean_reward, r.length, r.passes, r.trials, r.group] for _, r in recs],
            dtype=torch.float64,
        )
        return {
            "ids": torch.tensor([pid for pid, _ in recs], dtype=torch.int64),
            "flags": flags,
            "stats": floats.reshape(len(recs), 6),
            "seen": torch.tensor([r.seen for _, r in recs], dtype=torch.int64),
            "keep_base": self._base,
            "pending": list(self._pending),
            "last_share": self._last_share,
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            ids, flags, stats, seen = (state[k] for k in ("ids", "flags", "stats", "seen"))
            self._base = float(state["keep_base"])
            self._pending = [float(x) for x in state["pending"]]
            self._last_share = float(state["last_share"])
            self._generator.set_state(state["generator"])
        except KeyError as e:
            raise GRPOPartsError(
                f"prompt_skip state: expected the key {e.args[0]!r} (a history skipper's state)"
            ) from None
        self._records = {}
        for row, pid in enumerate(ids.tolist()):
            fl = [bool(x) for x in flags[row].tolist() if x >= 0][-self.window :]
            var, mean, length, passes, trials, group = stats[row].tolist()
            self._records[int(pid)] = PromptRecord(
                fl, var, mean, length, int(seen[row]), passes, trials, int(group)
            )


def zero_variance_probability(passes: float, trials: float, group: int) -> float:
    """``P(a group of `group` rollouts has zero reward variance)`` under a Beta(1 + passes,
    1 + trials - passes) posterior over the prompt's pass rate ``q``: ``E[q^G + (1 - q)^G]`` =
    ``B(a + G, b) / B(a, b) + B(a, b + G) / B(a, b)``; 0 for an empty group."""
    if group <= 0:
        return 0.0
    a, b = 1.0 + passes, 1.0 + max(0.0, trials - passes)

    def log_beta(x: float, y: float) -> float:
        return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)

    base = log_beta(a, b)
    return min(1.0, math.exp(log_beta(a + group, b) - base) + math.exp(log_beta(a, b + group) - base))


def _group_stats(
    n: int, rewards: torch.Tensor, group_index: torch.Tensor, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """Per group ``g < n`` (float64, CPU): row count, min, max, mean and population variance of the
    rewards, mean completion length (NaN without ``lengths``)."""
    check_tensor("rewards", rewards, ndim=1, dtype="float", allow_empty=True)
    rows = int(rewards.shape[0])
    check_tensor("group_index", group_index, shape=[rows], dtype="int", allow_empty=True)
    gi = group_index.detach().cpu().long()
    if rows and (int(gi.min()) < 0 or int(gi.max()) >= n):
        raise GRPOPartsError(
            f"group_index: expected values in [0, {n}) (positions in prompt_ids), "
            f"got range [{int(gi.min())}, {int(gi.max())}]"
        )
    r = rewards.detach().cpu().double()
    zeros = torch.zeros(n, dtype=torch.float64)
    count = zeros.index_add(0, gi, torch.ones_like(r))
    rmin = torch.full((n,), math.inf, dtype=torch.float64).scatter_reduce(0, gi, r, "amin")
    rmax = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce(0, gi, r, "amax")
    safe = count.clamp(min=1.0)
    mean = zeros.index_add(0, gi, r) / safe
    var = (zeros.index_add(0, gi, r * r) / safe - mean * mean).clamp(min=0.0)
    if lengths is None:
        length = torch.full((n,), math.nan, dtype=torch.float64)
    else:
        check_tensor("lengths", lengths, shape=[rows], allow_empty=True)
        length = zeros.index_add(0, gi, lengths.detach().cpu().double()) / safe
    return count, rmin, rmax, mean, var, length
