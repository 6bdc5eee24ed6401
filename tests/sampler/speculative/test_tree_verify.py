"""Recursive rejection sampling on sampled draft trees, driven directly (no model): a random policy
and a random draft far from it, tabulated per context on a 5-token vocabulary; trees built by
:func:`~grpo_parts.draft.tree_sampled.sampled_tree` and verified round after round until ``L``
tokens are out. Chi-square goodness of fit of the emitted ``L``-token sequences against the exact
distribution (temperatures 1.0 and 0.7, top-k, top-p; chains, stars, deep trees, widths past the
draft's support); a variant that does not renormalize ``q`` and one that prunes sampled children
by their values (EAGLE-2's rule) must fail."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import rrs_without_q_update

from grpo_parts.decoding import SamplingParams, sampling_probs
from grpo_parts.draft.protocol import DraftProposal, TreeBudget
from grpo_parts.draft.tree import Frontier
from grpo_parts.draft.tree_sampled import draw_without_replacement, sampled_tree
from grpo_parts.sampler.speculative.tree_verify import verify_sampled_tree, verify_tree
from grpo_parts.testing import chi_square_gof

V, L, SAMPLES = 5, 3, 4000
BASE = V + 1  # context code: sum (t + 1) * BASE**i, so every prefix has its own code
MAX_CTX = 7
SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7": dict(temperature=0.7),
    "t0.7_p0.8": dict(temperature=0.7, top_p=0.8),
    "topk2": dict(temperature=1.0, top_k=2),
}


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(BASE**MAX_CTX, V, generator=g, dtype=torch.float64) * 1.5
    q = torch.randn(BASE**MAX_CTX, V, generator=g, dtype=torch.float64) * 1.5  # far from p
    return p, q


P_TABLE, Q_TABLE = _tables(0)


def _params(setting: str) -> SamplingParams:
    return SamplingParams(group_size=1, max_new_tokens=L, **SETTINGS[setting])


def _exact(params: SamplingParams) -> np.ndarray:
    """Probability of every ``L``-token sequence, row-major (first token slowest)."""
    out = []
    for seq in itertools.product(range(V), repeat=L):
        code, prob = 0, 1.0
        for i, t in enumerate(seq):
            prob *= float(sampling_probs(P_TABLE[code], params)[t])
            code += (t + 1) * BASE**i
        out.append(prob)
    return np.array(out)


Builder = Callable[[torch.Tensor, torch.Tensor, TreeBudget, SamplingParams, torch.Generator], DraftProposal]


def _sampled(code: torch.Tensor, length: torch.Tensor, budget, params, gen) -> DraftProposal:  # type: ignore[no-untyped-def]
    def expand(fr: Frontier) -> torch.Tensor:
        pw = BASE ** (length[:, None] + torch.arange(fr.depth))  # [A, depth]
        c = code[:, None] + ((fr.paths + 1) * pw[:, None, :]).sum(-1)
        return Q_TABLE[c]

    return sampled_tree(Q_TABLE[code], expand, budget, params, gen)


def _pruned(code: torch.Tensor, length: torch.Tensor, budget, params, gen) -> DraftProposal:  # type: ignore[no-untyped-def]
    """WRONG on purpose: draw 3 root children without replacement, keep the 2 of highest ``q`` (a
    value-dependent shape, as EAGLE-2's best-N selection applied to sampled children)."""
    q = sampling_probs(Q_TABLE[code], params)
    drawn = draw_without_replacement(q, 3, gen)
    qd = q.gather(1, drawn)
    keep = qd.topk(2, 1).indices.sort(1).values  # keep draw order among the kept
    toks = drawn.gather(1, keep)
    a = code.shape[0]
    return DraftProposal(toks, q[:, None].expand(-1, 2, -1).float(), torch.full((a, 2), -1), sampled=True)


def _run(
    budget: TreeBudget, setting: str, verifier=verify_sampled_tree, build: Builder = _sampled, seed: int = 0
):  # type: ignore[no-untyped-def]
    """Emit ``L`` tokens per row by rounds of (sampled tree, one verification); returns the codes
    of the sequences (row-major) and the mean tokens per verification."""
    params, gen = _params(setting), torch.Generator().manual_seed(seed)
    seqs = torch.full((SAMPLES, L), -1, dtype=torch.long)
    code = torch.zeros(SAMPLES, dtype=torch.long)
    length = torch.zeros(SAMPLES, dtype=torch.long)
    verifies = 0
    while bool((length < L).any()):
        act = (length < L).nonzero().squeeze(1)
        c, n = code[act], length[act]
        prop = build(c, n, budget, params, gen)
        toks, par = prop.tokens, prop.chain_parents()
        a, k = toks.shape
        node_code = torch.zeros(a, k + 1, dtype=torch.long)  # column 0: the row's context
        node_len = torch.zeros(a, k + 1, dtype=torch.long)
        node_code[:, 0], node_len[:, 0] = c, n
        for i in range(k):  # parents precede children
            pc = par[:, i] + 1
            pl = node_len.gather(1, pc[:, None]).squeeze(1)
            node_code[:, i + 1] = node_code.gather(1, pc[:, None]).squeeze(1) + (toks[:, i] + 1) * BASE**pl
            node_len[:, i + 1] = pl + 1
        logits = P_TABLE[node_code]  # [A, k+1, V]
        n_acc, path, nxt = verifier(logits, toks, par, params, gen, probs=prop.probs)
        verifies += a
        for r in range(a):
            out = [int(toks[r, path[r, j] - 1]) for j in range(int(n_acc[r]))] + [int(nxt[r])]
            row = int(act[r])
            for t in out:
                if length[row] < L:
                    seqs[row, length[row]] = t
                    code[row] += (t + 1) * BASE ** int(length[row])
                    length[row] += 1
    codes = (seqs * torch.tensor([V ** (L - 1 - i) for i in range(L)])).sum(1)
    return codes, SAMPLES * L / verifies


BUDGETS = [
    TreeBudget(1, 1, 1),  # one sampled token: the chain residual rule
    TreeBudget(3, 3, 1),  # a chain
    TreeBudget(4, 1, 4),  # a star: four draws without replacement at the root
    TreeBudget(8, 3, 3),
    TreeBudget(12, 2, 5),  # all of the vocabulary at the root; past top-k / top-p support
]


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(budget=st.sampled_from(BUDGETS), setting=st.sampled_from(sorted(SETTINGS)), seed=st.integers(0, 3))
def test_rrs_lossless_chi_square(budget: TreeBudget, setting: str, seed: int) -> None:
    codes, _ = _run(budget, setting, seed=seed)
    assert chi_square_gof(codes, _exact(_params(setting))) > 1e-4


@pytest.mark.parametrize("setting", ["t1", "t0.7_p0.8"])
def test_rrs_lossless_every_budget(setting: str) -> None:
    exact = _exact(_params(setting))
    for budget in BUDGETS:
        codes, _ = _run(budget, setting)
        assert chi_square_gof(codes, exact) > 1e-4, budget


def test_wider_trees_emit_more() -> None:
    """Extra sampled children raise tokens per verification above the chain's (same depth)."""
    _, chain = _run(TreeBudget(3, 3, 1), "t1")
    _, tree = _run(TreeBudget(12, 3, 4), "t1")
    assert tree > chain + 0.2, (chain, tree)


@pytest.mark.parametrize(
    ("name", "budget", "verifier", "build"),
    [
        ("q not renormalized", TreeBudget(4, 1, 4), rrs_without_q_update, _sampled),
        ("value-dependent pruning", TreeBudget(2, 1, 2), verify_sampled_tree, _pruned),
    ],
)
def test_wrong_variants_fail(name: str, budget: TreeBudget, verifier, build) -> None:  # type: ignore[no-untyped-def]
    codes, _ = _run(budget, "t1", verifier=verifier, build=build)
    assert chi_square_gof(codes, _exact(_params("t1"))) < 1e-6, name


def test_greedy_is_sample_then_match() -> None:
    params = SamplingParams(group_size=1, max_new_tokens=L, temperature=0.0)
    logits = torch.randn(3, 5, V, generator=torch.Generator().manual_seed(1))
    tokens = logits[:, :4].argmax(-1)  # every node the policy's argmax at its parent ... on a chain
    parents = torch.tensor([-1, 0, 1, 2]).expand(3, -1)
    probs = torch.softmax(torch.randn(3, 4, V), -1)
    got = verify_sampled_tree(logits, tokens, parents, params, probs=probs)
    want = verify_tree(logits, tokens, parents, params)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
