"""Concurrency-aware tree sizing: how many draft-tree nodes per row when ``A`` rows are active.

FastGRPO's budget ``N = C / B`` with ``C`` measured, never a constant: a tree of ``N`` nodes is priced
with the measured ``t_verify(A, N + 1)``, draft and overhead costs, and yields
``E(N) = 1 + sum_{d=1..L} prod_{i<=d} r_i(N)`` tokens per row, ``r_i`` the measured per-depth
acceptance (prior ``1 - (1 - a)^w_i`` until measured). :func:`choose_plan` picks plain, chain or tree
by expected tokens per second. docs/speculative.md, "Sized by concurrency".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...draft.protocol import TreeBudget
from .acceptance import chain_expected_tokens
from .cost_model import CostModel


@dataclass
class TreeAcceptance:
    """Per tree size ``N``: decayed counts of rows that reached / accepted a node at each depth."""

    decay: float = 0.98
    prior_weight: float = 4.0
    reach: dict[int, list[float]] = field(default_factory=dict)
    accept: dict[int, list[float]] = field(default_factory=dict)

    def update(self, nodes: int, depth: int, num_accepted: torch.Tensor) -> None:
        r = self.reach.setdefault(nodes, [0.0] * depth)
        acc = self.accept.setdefault(nodes, [0.0] * depth)
        while len(r) < depth:
            r.append(0.0)
            acc.append(0.0)
        n = num_accepted.float()
        for d in range(depth):
            r[d] = r[d] * self.decay + float((n >= d).sum())
            acc[d] = acc[d] * self.decay + float((n >= d + 1).sum())

    def rates(self, budget: TreeBudget, chain_rate: float) -> list[float]:
        """``r_1 .. r_L`` for a tree of this budget (measured, shrunk towards the width prior)."""
        per_level = max(1.0, min(float(budget.width), (budget.nodes) / budget.depth))
        prior = 1.0 - (1.0 - chain_rate) ** per_level
        r = self.reach.get(budget.nodes, [])
        acc = self.accept.get(budget.nodes, [])
        out = []
        for d in range(budget.depth):
            seen, ok = (r[d], acc[d]) if d < len(r) else (0.0, 0.0)
            out.append(min((ok + prior * self.prior_weight) / (seen + self.prior_weight), 0.995))
        return out

    def expected_tokens(self, budget: TreeBudget, chain_rate: float) -> float:
        return chain_expected_tokens(self.rates(budget, chain_rate), budget.depth)


@dataclass
class TreeCost:
    """Measured draft seconds of trees per (batch-size bucket, nodes), EMA."""

    ema: float = 0.8
    draft: dict[tuple[int, int], float] = field(default_factory=dict)

    def observe(self, bucket: int, nodes: int, seconds: float) -> None:
        old = self.draft.get((bucket, nodes))
        self.draft[(bucket, nodes)] = seconds if old is None else self.ema * old + (1 - self.ema) * seconds

    def t_draft(self, cost: CostModel, a: int, budget: TreeBudget) -> float:
        """Measured, or before the first measurement a chain of the tree's depth (one draft call
        per level) scaled by the level's width relative to one token."""
        got = self.draft.get((cost.bucket(a), budget.nodes))
        if got is not None:
            return got
        return cost.t_draft(a, budget.depth) * max(1.0, budget.nodes / budget.depth) ** 0.5


def tree_step_time(cost: CostModel, trees: TreeCost, a: int, budget: TreeBudget) -> float:
    pred = cost.t_verify(a, budget.nodes + 1) + trees.t_draft(cost, a, budget)
    return (pred + cost.overhead_at(a, True, budget.nodes + 1)) * cost.scale_at(a, True)


def best_tree(
    cost: CostModel, trees: TreeCost, acceptance: TreeAcceptance, active: int, chain_rate: float,
    budgets: list[TreeBudget],
) -> tuple[TreeBudget | None, float]:  # fmt: skip
    """The tree budget with the most expected tokens per second per row, and that rate."""
    best: TreeBudget | None = None
    rate = 0.0
    for b in budgets:
        r = acceptance.expected_tokens(b, chain_rate) / tree_step_time(cost, trees, active, b)
        if r > rate:
            best, rate = b, r
    return best, rate


def choose_plan(
    cost: CostModel, trees: TreeCost, acceptance: TreeAcceptance, active: int, chain_rate: float,
    chain_k: int, budgets: list[TreeBudget], chain_rates: Sequence[float] | None = None,
) -> int | TreeBudget:  # fmt: skip
    """The best of the cost model's chain choice ``chain_k`` (0 = plain) and every tree budget;
    the chain is priced with its measured per-depth rates ``chain_rates`` where given (else with the
    geometric ``chain_rate``, which also sets the trees' prior)."""
    accept = chain_rate if chain_rates is None or len(chain_rates) < chain_k else chain_rates
    rate = cost.rate(active, chain_k, accept) * (cost.margin if chain_k == 0 else 1.0)
    tree, tree_rate = best_tree(cost, trees, acceptance, active, chain_rate, budgets)
    return tree if tree is not None and tree_rate > rate else chain_k
