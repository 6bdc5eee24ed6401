"""Cost model: expected tokens, concurrency-aware choice of the draft length, acceptance estimate."""

from __future__ import annotations

import pytest
import torch

from grpo_parts.sampler.speculative.acceptance import AcceptanceEstimate, expected_tokens
from grpo_parts.sampler.speculative.cost_model import CostModel, batch_grid


def gpu_like() -> CostModel:
    """Verification is free up to 64 tokens per step (``A * T``), then linear: FastGRPO's budget C = 64."""
    sizes, tokens = [1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 5, 7]
    table = {a: [1e-3 * max(1.0, a * t / 64) for t in tokens] for a in sizes}
    cost = CostModel(sizes, tokens, table)
    for a in sizes:
        cost.draft_fixed[a], cost.draft_per_token[a] = 1e-5, 2e-5
    return cost


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.8, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0


def test_draft_length_falls_with_concurrency_and_switches_off() -> None:
    cost = gpu_like()
    ks = [cost.choose(a, 0.8, 6) for a in (1, 4, 16, 32, 64)]
    assert ks[0] == 6 and ks[-1] == 0, ks  # long drafts when few rows are left, none when busy
    assert all(x >= y for x, y in zip(ks, ks[1:])), ks
    assert cost.choose(1, 0.02, 6) == 0  # a useless draft is switched off even when verification is free
    assert cost.break_even_acceptance(64) > 0.9


def test_online_overhead_and_draft_cost_move_the_choice() -> None:
    cost = gpu_like()
    assert cost.choose(4, 0.6, 6) > 0
    for _ in range(50):  # a slow draft measured online
        cost.observe_draft(4, 3, 0.05)
    assert cost.choose(4, 0.6, 6) == 0


def test_acceptance_estimate_is_geometric_mle() -> None:
    est = AcceptanceEstimate(prior=0.5, prior_weight=1e-9, decay=1.0)
    est.update(torch.tensor([3, 1]), k=3)  # 4 successes, 1 failure
    assert est.rate == pytest.approx(0.8)
    assert batch_grid(10) == [1, 2, 4, 8, 10]


def test_measured_steps_override_a_wrong_calibration() -> None:
    cost = gpu_like()  # claims verifying 7 tokens per row at batch 64 costs ~7x one token
    assert cost.choose(8, 0.8, 4) > 0
    k = cost.choose(8, 0.8, 4)
    for _ in range(3):  # but on this machine every speculative step at batch 8 is 10x slower
        cost.observe_step(8, k, 10 * cost.step_time(8, 0), 0.0)
        cost.observe_step(8, 0, cost.step_time(8, 0), 0.0)
    assert cost.choose(8, 0.8, 4) != k


def test_probes_back_off_while_speculation_stays_off() -> None:
    """With speculation off for low acceptance, k=1 probes come after 16, 32, 64, ... steps (so
    "off" costs next to nothing) and the gap resets once the cost model drafts again."""
    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.sampler.speculative.sampler import SpeculativeSampler
    from grpo_parts.tiny import tiny_causal_lm

    sampler = SpeculativeSampler(
        tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1), NGramDraft()
    )
    sampler.cost = gpu_like()
    sampler.acceptance = AcceptanceEstimate(prior=0.01)
    assert sampler.cost.break_even_acceptance(1) < 1.0
    probes = [i + 1 for i in range(200) if sampler.choose_k(1, 100, i) == 1]
    assert probes == [16, 48, 112]
    sampler.acceptance = AcceptanceEstimate(prior=0.9)
    assert sampler.choose_k(1, 100, 0) > 0
    assert sampler._probe_gap[1] == sampler.config.probe_every


def test_probes_also_where_the_calibration_says_drafting_cannot_pay() -> None:
    """A calibration that prices every draft out (break-even acceptance >= 1) still gets k=1 probes
    with the same back-off, so a disturbed calibration cannot keep speculation off for good; the
    probe's measured step corrects it."""
    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.sampler.speculative.sampler import SpeculativeSampler
    from grpo_parts.tiny import tiny_causal_lm

    sampler = SpeculativeSampler(
        tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1), NGramDraft()
    )
    sampler.cost = cost = gpu_like()
    cost.verify = {b: [t * 50 for t in ts] for b, ts in cost.verify.items()}  # verification "costs" 50x
    cost.verify = {b: [ts[0] / 50] + ts[1:] for b, ts in cost.verify.items()}  # ... but plain steps do not
    sampler.acceptance = AcceptanceEstimate(prior=0.9)
    assert cost.break_even_acceptance(1) >= 1.0
    probes = [i + 1 for i in range(200) if sampler.choose_k(1, 100, i) == 1]
    assert probes == [16, 48, 112]
    for _ in range(5):  # the probes measure a speculative step as cheap as a plain one
        cost.observe_step(1, 1, cost.step_time(1, 0), 0.0)
    assert sampler.choose_k(1, 100, 0) > 0


def test_slow_speculative_steps_correct_every_draft_length() -> None:
    """Speculative steps measured 3x slower than predicted (twice in a row: one could be the host)
    scale the prediction of the draft lengths not tried yet at that batch size too, so the sampler
    switches speculation off instead of paying for one bad step per draft length."""
    cost = gpu_like()
    k = cost.choose(16, 0.7, 6)
    assert k > 0
    for _ in range(2):
        cost.observe_step(16, k, 3 * cost._predict(16, k), 0.0)
    assert cost.scale[(16, True)] == pytest.approx(3.0)
    assert cost.choose(16, 0.7, 6) == 0
    assert cost.choose(1, 0.7, 6) > 0  # other batch sizes keep their own estimate


def test_one_disturbed_step_moves_nothing() -> None:
    """One step the host stalled (13x its prediction, as the first 128-row speculative step of a
    main-job run measured) neither rescales that batch size nor adds to its overhead: a running
    mean seeded by it priced speculation out there for the whole run."""
    cost = gpu_like()
    k = cost.choose(16, 0.7, 6)
    cost.observe_step(16, k, 13 * cost._predict(16, k), 0.0)
    assert cost.scale[(16, True)] == 1.0 and cost.overhead_at(16, True) == 0.0
    assert cost.choose(16, 0.7, 6) == k
    cost.observe_step(16, k, cost._predict(16, k), 0.0)
    cost.observe_step(16, k, 13 * cost._predict(16, k), 0.0)  # a second outlier, not in a row
    assert cost.scale[(16, True)] == pytest.approx(1.0)


def test_two_probes_undo_a_stale_estimate() -> None:
    """A speculative level measured slow four times, then two steps as predicted: the estimate
    follows the new measurements (a running mean kept 0.8^2 of the stale 4x)."""
    cost = gpu_like()
    for _ in range(4):
        cost.observe_step(16, 2, 4 * cost._predict(16, 2), 0.0)
    assert cost.scale[(16, True)] == pytest.approx(4.0)
    cost.observe_step(16, 1, cost._predict(16, 1), 0.0)
    cost.observe_step(16, 1, cost._predict(16, 1), 0.0)
    assert cost.scale[(16, True)] == pytest.approx(1.0)


def test_a_cheap_probe_brings_the_next_one_forward() -> None:
    """Where speculation is priced out, a probe that measures the step well below its price makes
    the next probe come after ``probe_every`` steps rather than after the doubled gap."""
    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.sampler.speculative.sampler import SpeculativeSampler
    from grpo_parts.tiny import tiny_causal_lm

    sampler = SpeculativeSampler(
        tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1), NGramDraft()
    )
    sampler.cost = cost = gpu_like()
    sampler.acceptance = AcceptanceEstimate(prior=0.9)
    calibrated = cost._predict(1, 1)
    for _ in range(4):  # speculation at 1 row measured 20x its price: off
        cost.observe_step(1, 1, 20 * calibrated, 0.0)
    assert cost.break_even_acceptance(1) >= 1.0
    probes = []
    for i in range(60):
        if sampler.choose_k(1, 100, i) == 1:
            probes.append(i + 1)
            cost.observe_step(1, 1, calibrated, 0.0)  # the probe runs at its calibrated cost
    assert probes[:2] == [16, 32]  # not 16, 48
    assert sampler.choose_k(1, 100, 0) > 0
    assert cost.step_time(1, 1) == pytest.approx(calibrated)


def cpu_like() -> CostModel:
    """The bench's task policy on the 2-core CPU: a plain step 23 ms at 1 row, 55 ms at 64 rows;
    each drafted token adds ~3 ms at 1 row and ~36 ms at 64; an n-gram draft costs next to nothing."""
    sizes, tokens = [1, 64], [1, 2, 3, 5, 7]
    table = {1: [23e-3, 26e-3, 29e-3, 35e-3, 45e-3], 64: [55e-3, 91e-3, 127e-3, 199e-3, 264e-3]}
    cost = CostModel(sizes, tokens, table)
    for a in sizes:
        cost.draft_fixed[a], cost.draft_per_token[a] = 1e-5, 1e-6
    return cost


def test_overhead_measured_at_one_batch_size_stays_there() -> None:
    """A start-up table that under-timed the 64-row forward (55 ms, every plain step measured at
    80 ms) leaves a 25 ms residual at 64 rows; it must not price plain steps at 1 row at 48 ms, which
    made the n-gram draft (acceptance 0.2) draft at a loss in the tail of a batch-64 rollout."""
    cost = cpu_like()
    assert cost.choose(1, 0.2, 6) == 0
    for _ in range(50):
        cost.observe_step(64, 0, 80e-3, 0.0)
    assert cost.overhead_at(64, False) == pytest.approx(25e-3, rel=1e-3)
    assert cost.step_time(64, 0) == pytest.approx(80e-3, rel=1e-3)
    assert cost.overhead_at(1, False) == 0.0 and cost.step_time(1, 0) == pytest.approx(23e-3)
    assert cost.choose(1, 0.2, 6) == 0
    assert cost.choose(1, 0.6, 6) > 0  # a draft that pays at 1 row still drafts there


def test_probes_back_off_per_batch_size() -> None:
    """Drafting in the 1-row tail of each rollout does not reset the probe back-off of the 64-row
    steps, where speculation is off: over 10 rollouts of 20 steps at 64 rows the probes there come
    after 16, 48, 112 of its steps (not once per rollout)."""
    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.sampler.speculative.sampler import SpeculativeSampler
    from grpo_parts.tiny import tiny_causal_lm

    sampler = SpeculativeSampler(
        tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1), NGramDraft()
    )
    sampler.cost = cost = cpu_like()
    sampler.acceptance = AcceptanceEstimate(prior=0.6)
    assert cost.choose(64, 0.6, 6) == 0 and cost.choose(1, 0.6, 6) > 0
    probes, n64 = [], 0
    for _ in range(10):
        for _ in range(20):
            n64 += 1
            if sampler.choose_k(64, 100, 0) > 0:
                probes.append(n64)
        for _ in range(5):
            assert sampler.choose_k(1, 100, 0) > 0
    assert probes == [16, 48, 112], probes


def test_tree_size_follows_concurrency() -> None:
    """On GPU-like costs (verification free up to 64 tokens per step) with a draft whose trees are
    measured to accept deep, trees are picked when few rows are active and shrink / give way to
    chains or plain decoding as rows are added; measured acceptance, not the prior, decides."""
    from grpo_parts.draft.protocol import TreeBudget
    from grpo_parts.sampler.speculative.sampler import SpeculativeConfig
    from grpo_parts.sampler.speculative.tree_cost import TreeAcceptance, TreeCost, choose_plan

    cost, cfg = gpu_like(), SpeculativeConfig()
    budgets = [cfg.tree_budget(n) for n in (4, 8, 16, 32)]
    acc = TreeAcceptance(decay=1.0)
    for b in budgets:  # measured: a row accepts a node at every depth 90% of the time
        for _ in range(50):
            acc.update(b.nodes, b.depth, torch.tensor([b.depth] * 9 + [0]))
    plans = [
        choose_plan(cost, TreeCost(), acc, a, 0.5, cost.choose(a, 0.5, 6), budgets) for a in (1, 4, 16, 64)
    ]
    nodes = [p.nodes if isinstance(p, TreeBudget) else 0 for p in plans]
    assert nodes[0] == 32 and nodes[-1] == 0, plans
    assert all(x >= y for x, y in zip(nodes, nodes[1:])), plans
    bad = TreeAcceptance(decay=1.0)
    for b in budgets:  # trees measured to accept nothing: never picked
        for _ in range(50):
            bad.update(b.nodes, b.depth, torch.zeros(10, dtype=torch.long))
    assert not isinstance(
        choose_plan(cost, TreeCost(), bad, 1, 0.5, cost.choose(1, 0.5, 6), budgets), TreeBudget
    )


def test_chains_and_trees_probe_each_other() -> None:
    """While trees win, a chain runs every ``probe_every`` decisions (its acceptance is only measured
    by chain steps: a prior that never moves must not lock in trees); trees measured to accept
    nothing are never probed (their predicted rate is far below the chains')."""
    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.draft.protocol import TreeBudget
    from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
    from grpo_parts.sampler.speculative.tree_cost import TreeAcceptance
    from grpo_parts.tiny import tiny_causal_lm

    def run(sampler: SpeculativeSampler, steps: int) -> list[str]:
        kinds = []
        for i in range(steps):
            plan = sampler.choose_plan(1, 100, i, 1 << 30)
            kind = "tree" if isinstance(plan, TreeBudget) else "chain" if plan > 0 else "plain"
            if kind != "plain":  # what _speculative_step records when it runs the shape
                sampler._last_shape[kind] = sampler._shape_steps
            kinds.append(kind)
        return kinds

    model = tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1, attn_implementation="sdpa")
    sampler = SpeculativeSampler(model, NGramDraft(), SpeculativeConfig(max_tree_nodes=32))
    sampler.cost, sampler.tree_acceptance = gpu_like(), TreeAcceptance(decay=1.0)
    for b in sampler.tree_budgets():  # trees measured to accept at every depth
        for _ in range(50):
            sampler.tree_acceptance.update(b.nodes, b.depth, torch.full((10,), b.depth))
    kinds = run(sampler, 64)
    chains = [i + 1 for i, k in enumerate(kinds) if k == "chain"]
    assert chains == [2, 6, 14, 30, 46, 62], kinds  # gaps 2, 4, 8, then every probe_every = 16
    assert kinds.count("tree") == 58

    sampler = SpeculativeSampler(model, NGramDraft(), SpeculativeConfig(max_tree_nodes=32))
    sampler.cost, sampler.tree_acceptance = gpu_like(), TreeAcceptance(decay=1.0)
    sampler.acceptance = AcceptanceEstimate(prior=0.9)
    for b in sampler.tree_budgets():  # trees measured to accept nothing
        for _ in range(50):
            sampler.tree_acceptance.update(b.nodes, b.depth, torch.zeros(10, dtype=torch.long))
    assert set(run(sampler, 48)) == {"chain"}


def test_k_schedule_is_choose_at_every_batch_size_as_ranges() -> None:
    """The table vLLM's dynamic schedule takes: ranges from 1, contiguous, equal to ``choose``."""
    from grpo_parts.sampler.vllm import check_k_table

    cost = gpu_like()
    table = cost.k_schedule(0.8, 6, 100)
    assert check_k_table(table, 6) == [] and table[-1][1] == 100
    for lo, hi, k in table:
        assert all(cost.choose(a, 0.8, 6) == k for a in range(lo, hi + 1))
    assert table[0][2] == 6 and table[-1][2] == 0  # long drafts at few rows, none when busy
    assert all(a[2] != b[2] for a, b in zip(table, table[1:]))  # merged: neighbours differ
    # a better draft speculates at more batch sizes
    assert sum(hi - lo + 1 for lo, hi, k in cost.k_schedule(0.95, 6, 100) if k > 0) >= sum(
        hi - lo + 1 for lo, hi, k in table if k > 0
    )
