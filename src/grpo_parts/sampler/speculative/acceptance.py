"""Online chain acceptance for the cost model: the geometric per-token rate and the measured per-depth
acceptance of chains, per batch-size bucket, and the expected tokens a verification emits under each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def expected_tokens(a: float, k: int) -> float:
    """Mean tokens emitted per row by one verification of ``k`` drafted tokens (bonus included)."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def chain_expected_tokens(rates: Sequence[float], k: int) -> float:
    """Mean tokens emitted per row by a ``k``-chain whose depth ``d`` is accepted with probability
    ``rates[d - 1]`` given depth ``d - 1`` was: ``1 + sum_{d<=k} prod_{i<=d} r_i`` (bonus included)."""
    total, run = 1.0, 1.0
    for r in rates[: max(k, 0)]:
        run *= r
        total += run
    return total


#: key of the per-depth counts pooled over every batch-size bucket
POOLED = 0


@dataclass
class AcceptanceEstimate:
    """Online chain acceptance: a geometric per-token ``rate`` and, per batch-size bucket, the
    measured **per-depth** acceptance ``r_d`` (:meth:`depth_rates`), both with exponential forgetting.

    ``rate``: a chain of ``k`` drafts with ``n`` accepted is ``n`` successes and (if ``n < k``) one
    failure of a geometric model, so ``a = successes / trials`` is its maximum-likelihood estimate
    (used for the trace, the trees' prior and as the prior of the per-depth rates).

    ``r_d``: the fraction of rows that accepted draft position ``d`` among those that accepted
    ``d - 1`` (real acceptance is not geometric: docs/speculative.md, "N-gram draft in the tail").
    A bucket's counts shrink towards the pooled counts (``prior_weight`` steps' worth), which shrink
    towards the prior ``min(rate, pooled r_{d-1})``; a chain may be at most one position deeper than
    the deepest depth measured, so each longer ``k`` is tried one step at a time.
    """

    prior: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.98
    successes: float = 0.0
    trials: float = 0.0
    #: per bucket (``POOLED``: all): decayed fraction of rows that reached / accepted each depth
    reach: dict[int, list[float]] = field(default_factory=dict)
    accept: dict[int, list[float]] = field(default_factory=dict)
    #: a depth counts as measured once this many verification steps' worth of rows reached it
    min_reach: float = 0.5

    @property
    def rate(self) -> float:
        a = (self.successes + self.prior * self.prior_weight) / (self.trials + self.prior_weight)
        return min(a, 0.995)

    def update(self, num_accepted: torch.Tensor, k: int, bucket: int | None = None) -> None:
        """Fold one verification of ``k``-chains (``num_accepted`` per row) into the estimates;
        ``bucket``: the cost model's calibrated batch size of the step (None: pooled only)."""
        if k <= 0 or num_accepted.numel() == 0:
            return
        rows = num_accepted.numel()
        s = float(num_accepted.sum())
        t = s + float((num_accepted < k).sum())
        # forget per verification step, weighting by rows so big batches are not drowned out
        self.successes = self.successes * self.decay + s / rows
        self.trials = self.trials * self.decay + t / rows
        n = num_accepted.float()
        reached = [float((n >= d).sum()) / rows for d in range(k + 1)]  # reached[d]: accepted >= d
        for key in {POOLED, POOLED if bucket is None else bucket}:
            r, acc = self.reach.setdefault(key, []), self.accept.setdefault(key, [])
            while len(r) < k:
                r.append(0.0)
                acc.append(0.0)
            for d in range(len(r)):  # every depth forgets; only the drafted ones gain counts
                r[d] *= self.decay
                acc[d] *= self.decay
                if d < k:
                    r[d] += reached[d]
                    acc[d] += reached[d + 1]

    def measured_depth(self, bucket: int | None) -> int:
        """The deepest draft position enough rows reached, in ``bucket`` or pooled."""
        best = 0
        for key in {POOLED, POOLED if bucket is None else bucket}:
            r = self.reach.get(key, [])
            best = max([best] + [d + 1 for d in range(len(r)) if r[d] >= self.min_reach])
        return best

    def depth_rates(self, bucket: int | None, max_k: int) -> list[float]:
        """``r_1 .. r_m`` with ``m = min(max_k, measured_depth + 1)``: the chain lengths worth
        pricing now (one position past the measured ones: a cheap probe of the next depth)."""
        m = min(max_k, self.measured_depth(bucket) + 1)
        w, prior, out = self.prior_weight, self.rate, []
        pr, pa = self.reach.get(POOLED, []), self.accept.get(POOLED, [])
        br = self.reach.get(POOLED if bucket is None else bucket, [])
        ba = self.accept.get(POOLED if bucket is None else bucket, [])
        for d in range(m):
            pooled = (_at(pa, d) + prior * w) / (_at(pr, d) + w)
            out.append(min((_at(ba, d) + pooled * w) / (_at(br, d) + w), 0.995))
            prior = min(self.rate, pooled)  # an unmeasured depth: no better than the one before
        return out


def _at(xs: list[float], i: int) -> float:
    return xs[i] if i < len(xs) else 0.0
