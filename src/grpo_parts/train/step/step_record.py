"""What one training step's sampler and reward calls leave behind (:class:`StepRecord`), and the
step's sampler metrics from its rollouts' ``Rollout.stats``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...sampler.stats import ACCEPTED_PER_VERIFY, STEP_CALL_COUNTS
from ...task.data import Problem
from ...types import Rollout


@dataclass
class StepRecord:
    """What one step's sampler and reward calls left: seconds in the sampler, completion tokens,
    rewards ``[N]`` per call, ``Rollout.stats`` and rollouts per call, and per row the grader's
    verdict and ``(completion, problem, reward)``."""

    rollout_s: float = 0.0
    tokens: int = 0
    rewards: list[torch.Tensor] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)
    rollouts: list[Rollout] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    samples: list[tuple[str, Problem, float]] = field(default_factory=list)


def rollout_metrics(stats: list[dict[str, float]]) -> dict[str, float | None]:
    """A step's sampler metrics from its rollouts' ``Rollout.stats``: the mean tokens per verification and the
    speculative decode loop's attention calls and forwards per path, summed (None: no rollout reported it)."""
    apv = [s[ACCEPTED_PER_VERIFY] for s in stats if ACCEPTED_PER_VERIFY in s]
    out: dict[str, float | None] = {ACCEPTED_PER_VERIFY: sum(apv) / len(apv) if apv else None}
    for key in STEP_CALL_COUNTS:
        calls = [s[key] for s in stats if key in s]
        out[key] = sum(calls) if calls else None
    return out


def zero_variance_share(record: StepRecord) -> float | None:
    """Share of the step's rolled-out groups whose rewards are all equal (zero advantage, no policy
    gradient: the rollouts prompt skipping tries to avoid); None when nothing was rolled out."""
    from ...core import group_stats

    groups = zero = 0
    for ro, r in zip(record.rollouts, record.rewards):
        present = torch.unique(ro.group_index)
        z = group_stats(r.double().cpu(), ro.group_index.cpu(), int(ro.group_index.max()) + 1)[3]
        groups, zero = groups + int(present.numel()), zero + int(z[present.cpu()].sum())
    return zero / groups if groups else None
