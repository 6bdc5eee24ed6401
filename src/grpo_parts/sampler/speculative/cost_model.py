"""Concurrency-aware draft sizing: how many tokens to draft when ``A`` rows are still generating.

A step with draft length ``k`` costs ``t_verify(A, k + 1) + t_draft(A, k)`` and emits
``E(a, k) = (1 - a^(k+1)) / (1 - a)`` tokens per row; the ``k`` with the most tokens per second wins
(``k = 0``: plain decoding). Unlike FastGRPO's hand-set budget ``C``, the costs are measured on the
running machine (:mod:`.calibration`) and refined online. docs/speculative.md, "The cost model".
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .acceptance import chain_expected_tokens, expected_tokens


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation from the last two points."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if x > xs[0] else 1.0)
    i = min(max(bisect.bisect_left(list(xs), x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 1e-9)


def nearest_size(sizes: Iterable[int], a: int) -> int:
    """The size closest to ``a`` on a log scale (batch sizes are calibrated on a doubling grid)."""
    return min(sizes, key=lambda x: abs(math.log(x) - math.log(max(a, 1))))


@dataclass
class CostModel:
    """Measured step costs. ``verify[A][j]`` = seconds for a policy forward of ``A`` rows x
    ``tokens[j]`` tokens with a warm cache; ``draft_fixed[A]`` + ``k * draft_per_token[A]`` = seconds
    for ``draft.propose`` of ``k`` tokens on ``A`` rows (refined online by :meth:`observe_draft`)."""

    batch_sizes: list[int]
    tokens: list[int]
    verify: dict[int, list[float]]
    draft_fixed: dict[int, float] = field(default_factory=dict)
    draft_per_token: dict[int, float] = field(default_factory=dict)
    #: per-step bookkeeping beyond the forward and the draft per (calibrated batch size, speculative?),
    #: measured online (0 until then); speculative steps: seconds per verified position, as it grows
    #: with ``k + 1``. Per batch size and per position: docs/results.md; the log's "Robust step-time
    #: corrections, collector paused in decode loops"
    overhead: dict[tuple[int, bool], float] = field(default_factory=dict)
    #: EMA weight of :meth:`observe_draft` (draft times are short and steady)
    ema: float = 0.8
    #: a draft length must beat plain decoding by this factor (timing noise must not flip decisions)
    margin: float = 1.1
    #: measured / predicted wall time per (calibrated batch size, speculative?): corrects every
    #: prediction at that batch size, draft lengths not tried yet included (cache housekeeping,
    #: sampling and verification maths grow with ``A x (k + 1)`` and are not in the calibrated forward)
    scale: dict[tuple[int, bool], float] = field(default_factory=dict)
    #: the measurements per key that ``scale`` and ``overhead`` are the medians of
    recent: dict[tuple[int, bool], RecentSteps] = field(default_factory=dict)
    #: decode attention calls per path while the table was timed (all 0: the model's own attention)
    calibration_calls: dict[str, int] = field(default_factory=dict)
    _memo: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    def t_verify(self, a: int, t: int) -> float:
        key = (a, t)
        if key not in self._memo:  # the table is fixed after calibration
            per_a = [_interp(self.tokens, self.verify[b], float(t)) for b in self.batch_sizes]
            self._memo[key] = _interp([float(b) for b in self.batch_sizes], per_a, float(a))
        return self._memo[key]

    def t_draft(self, a: int, k: int) -> float:
        if k <= 0 or not self.draft_fixed:
            return 0.0
        if (a, -k) in self._memo:
            return self._memo[(a, -k)]
        bs = sorted(self.draft_fixed)
        f = _interp([float(b) for b in bs], [self.draft_fixed[b] for b in bs], float(a))
        g = _interp([float(b) for b in bs], [self.draft_per_token[b] for b in bs], float(a))
        self._memo[(a, -k)] = f + k * g  # negative key: draft entries (cleared when draft costs move)
        return f + k * g

    def observe_draft(self, a: int, k: int, seconds: float) -> None:
        """Fold a measured ``draft.propose`` time into the nearest calibrated batch size."""
        if k <= 0 or not self.draft_fixed:
            return
        b = nearest_size(self.draft_fixed, a)
        pred = self.draft_fixed[b] + k * self.draft_per_token[b]
        scale = (seconds * b / max(a, 1) if a > b else seconds) / max(pred, 1e-9)
        scale = min(max(scale, 0.25), 4.0)
        m = self.ema + (1 - self.ema) * scale
        self.draft_fixed[b] *= m
        self.draft_per_token[b] *= m
        for key in [key for key in self._memo if key[1] < 0]:
            del self._memo[key]

    def observe_step(
        self, a: int, k: int, seconds: float, draft_seconds: float, predicted: float | None = None,
        tokens: int | None = None,
    ) -> None:  # fmt: skip
        """Fold a whole step's wall time into the measured / predicted ratio of its kind (plain or
        speculative) at the nearest calibrated batch size, and into the bookkeeping overhead of its
        kind. Predictions are then scaled by that ratio, so a start-up table taken under different
        load corrects itself, while the *shape* of the cost in ``k`` stays the calibrated one (a
        per-``k`` measurement would let timing noise on one step lock in a worse draft length).

        Both are lower medians (:class:`RecentSteps`; docs/results.md, the log's "Robust step-time
        corrections")."""
        key = (self.bucket(a), k > 0)
        ratio = seconds / max(self._predict(a, k) if predicted is None else predicted, 1e-9)
        t = k + 1 if tokens is None else tokens
        resid = max(seconds - draft_seconds - self.t_verify(a, t), 0.0) / t
        rec = self.recent.setdefault(key, RecentSteps())
        rec.add(ratio, resid)
        self.scale[key], self.overhead[key] = rec.ratio(), rec.residual()

    def last_ratio(self, a: int, speculative: bool) -> float | None:
        """Measured / predicted time of the last step of that kind at ``a``'s batch-size bucket."""
        rec = self.recent.get((self.bucket(a), speculative))
        return rec.ratios[-1] if rec is not None and rec.ratios else None

    def scale_at(self, a: int, speculative: bool) -> float:
        """Measured / predicted step time of that kind at the calibrated batch size nearest ``a``
        (1 where not measured yet)."""
        return self.scale.get((self.bucket(a), speculative), 1.0)

    def overhead_at(self, a: int, speculative: bool, tokens: int = 1) -> float:
        """Measured per-step bookkeeping of that kind at the calibrated batch size nearest ``a``, for a
        step verifying ``tokens`` positions per row (plain: 1)."""
        return self.overhead.get((self.bucket(a), speculative), 0.0) * tokens

    def bucket(self, a: int) -> int:
        """The calibrated batch size nearest ``a`` (the key of the per-size tables)."""
        return nearest_size(self.batch_sizes, a)

    def _predict(self, a: int, k: int) -> float:
        return self.t_verify(a, k + 1) + self.t_draft(a, k) + self.overhead_at(a, k > 0, k + 1)

    def step_time(self, a: int, k: int) -> float:
        return self._predict(a, k) * self.scale_at(a, k > 0)

    def rate(self, a: int, k: int, accept: float | Sequence[float]) -> float:
        """Tokens per second per row at draft length ``k``; ``accept``: a geometric per-token rate or
        the per-depth rates ``r_1 .. r_m`` (:meth:`AcceptanceEstimate.depth_rates`, ``m >= k``)."""
        if isinstance(accept, (int, float)):
            return expected_tokens(float(accept), k) / self.step_time(a, k)
        return chain_expected_tokens(accept, k) / self.step_time(a, k)

    def choose(self, active: int, accept: float | Sequence[float], max_k: int) -> int:
        """Draft length with the highest expected throughput (0 = plain decoding); with per-depth
        rates, at most ``len(accept)``."""
        if not isinstance(accept, (int, float)):
            max_k = min(max_k, len(accept))
        best_k, best = 0, self.rate(active, 0, accept) * self.margin
        for k in range(1, max_k + 1):
            r = self.rate(active, k, accept)
            if r > best:
                best_k, best = k, r
        return best_k

    def k_schedule(
        self, accept: float | Sequence[float], max_k: int, max_rows: int
    ) -> list[tuple[int, int, int]]:
        """:meth:`choose` at every batch size ``1 .. max_rows``, as inclusive ranges of equal draft
        length ``[(first, last, k), ...]`` starting at 1: the concurrency-aware draft length in the
        form a static scheduler takes (vLLM's ``num_speculative_tokens_per_batch_size``)."""
        out: list[tuple[int, int, int]] = []
        for a in range(1, max_rows + 1):
            k = self.choose(a, accept, max_k)
            if out and out[-1][2] == k:
                out[-1] = (out[-1][0], a, k)
            else:
                out.append((a, a, k))
        return out

    def break_even_acceptance(self, active: int) -> float:
        """Smallest acceptance rate at which drafting one token beats plain decoding (>= 1: never)."""
        return self.margin * self.step_time(active, 1) / self.step_time(active, 0) - 1.0


#: measurements per (batch size, kind) that the step-time corrections are medians of
RECENT = 4


@dataclass
class RecentSteps:
    """The last :data:`RECENT` measured / predicted ratios and per-position residuals of one kind
    of step at one batch size. Estimates are lower medians over them plus one prior entry (ratio 1,
    residual 0): robust to a single disturbed step, yet a level measured twice in a row is taken."""

    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    residuals: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def add(self, ratio: float, residual: float) -> None:
        self.ratios.append(ratio)
        self.residuals.append(residual)

    def ratio(self) -> float:
        return _lower_median([1.0, *self.ratios])

    def residual(self) -> float:
        return _lower_median([0.0, *self.residuals])


def _lower_median(xs: list[float]) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]


def batch_grid(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to (and including) ``max_rows``."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    out.append(max_rows)
    return out


def token_grid(max_tokens: int) -> list[int]:
    """Tokens per row timed at start-up: 1 and 2 (where a CPU matmul leaves its matrix-vector path),
    then doubling to ``max_tokens``; interpolated between, rescaled online. Few points: each costs a
    forward per batch size and repeat (the log's "Calibration on the decode loop's own forwards")."""
    return sorted({t for t in (1, 2, 4, 8, 16, 32, 64, max_tokens) if t <= max_tokens})
