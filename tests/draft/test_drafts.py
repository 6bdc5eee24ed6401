"""Draft models: Protocol conformance, n-gram lookup sources, EAGLE cache consistency, online
learning and checkpoint round trips."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_parts.draft import IMPLEMENTATIONS, get_draft_class
from grpo_parts.draft.eagle import EagleConfig, EagleDraft
from grpo_parts.draft.ngram import NGramDraft, _Pool
from grpo_parts.draft.protocol import DraftContext, DraftModel, DraftTrainingBatch
from grpo_parts.draft.reference import FrozenLMDraft
from grpo_parts.errors import GRPOPartsError
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.tiny import tiny_causal_lm

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=2, seed=0)


def ctx(rows: list[list[int]], ids: list[int], groups: list[int], hidden=None, num_new=None) -> DraftContext:
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = torch.tensor(r)
    return DraftContext(
        tokens, torch.tensor([len(r) for r in rows]), torch.tensor(ids), torch.tensor(groups),
        hidden=None if hidden is None else hidden[:, -1], new_hidden=hidden, num_new=num_new,
    )  # fmt: skip


def test_registered_drafts_conform(policy: torch.nn.Module) -> None:
    assert {"frozen_lm", "ngram", "eagle"} <= set(IMPLEMENTATIONS)
    drafts = [FrozenLMDraft(copy.deepcopy(policy)), NGramDraft(), EagleDraft(policy)]
    for d in drafts:
        assert isinstance(d, DraftModel), type(d).__name__
        assert d.not_supported_reasons(policy, GREEDY) == []
    assert get_draft_class("ngram") is NGramDraft


def test_ngram_uses_siblings_and_history() -> None:
    d = NGramDraft(max_ngram=3)
    prompts = torch.tensor([[0, 7, 8], [0, 7, 8], [9, 9, 9]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    d.reset(prompts, mask, torch.tensor([0, 0, 1]))
    # row 0 has written "1 2 3 4 5"; its sibling row 1 has just written "1 2": propose "3 4"
    out = d.propose(ctx([[7, 8, 1, 2, 3, 4, 5], [7, 8, 1, 2]], [0, 1], [0, 0]), 2, GREEDY)
    assert out.probs is None
    assert out.tokens[1].tolist() == [3, 4]
    # a later rollout of the same prompt finds the earlier completions (history), not other prompts'
    d.observe(torch.tensor([[1, 2, 3, 4, 5], [1, 2, 0, 0, 0], [6, 6, 6, 6, 6]]), torch.tensor([[1] * 5, [1, 1, 0, 0, 0], [1] * 5]), torch.tensor([0, 0, 1]))  # fmt: skip
    d.reset(prompts[:1], mask[:1], torch.tensor([0]))
    out = d.propose(ctx([[7, 8, 1]], [0], [0]), 3, GREEDY)
    assert out.tokens[0].tolist() == [2, 3, 4]
    restored = NGramDraft(max_ngram=3)
    restored.load_state_dict(d.state_dict())
    restored.reset(prompts[:1], mask[:1], torch.tensor([0]))
    assert restored.propose(ctx([[7, 8, 1]], [0], [0]), 3, GREEDY).tokens.tolist() == out.tokens.tolist()
    with pytest.raises(GRPOPartsError, match="min_ngram"):
        NGramDraft(max_ngram=1, min_ngram=2)


def test_ngram_pools_are_built_at_first_use_with_the_same_proposals() -> None:
    """A rollout that never drafts builds no pool (reset only remembers the prompts); one that does
    proposes exactly what pools built from scratch for every row at reset (the earlier behaviour)
    propose, also where a prompt's indexed history is kept between rollouts and its oldest
    completions are dropped (``history_per_prompt=2``, 4 rollouts)."""
    from grpo_parts.draft.ngram import _Pool
    from grpo_parts.draft.protocol import TreeBudget

    class Eager(NGramDraft):
        """The earlier behaviour: at reset, one pool per group indexing its prompt and history."""

        def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
            super().reset(prompts, prompt_mask, group_index)
            for r in range(prompts.shape[0]):
                self._row(r)

        def _row(self, r: int) -> tuple[_Pool, int]:
            g = self._row_group[r]
            if g not in self._pools:
                key = self._keys[g]
                pool = self._pools[g] = _Pool(self.lo, self.hi)
                pool.add(list(key))
                for old in self.history.get(key, []):
                    pool.add(list(key) + old, known=len(key))
            if r not in self._row_sid:
                prompt = self._row_prompt[r]
                self._row_sid[r] = self._pools[g].add(prompt, known=len(prompt))
            return self._pools[g], self._row_sid[r]

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 6, (6, 5), generator=gen)
    prompts[3:] = prompts[:3]  # groups of two rows sharing a prompt
    mask, groups = torch.ones_like(prompts), torch.tensor([0, 1, 2, 0, 1, 2])
    lazy = NGramDraft(max_ngram=3, history_per_prompt=2)
    for rollout in range(4):
        eager = Eager(max_ngram=3, history_per_prompt=2)  # nothing kept from earlier rollouts
        eager.load_state_dict(lazy.state_dict())
        for d in (lazy, eager):
            d.reset(prompts, mask, groups)
        assert lazy.pools_built == 3 * rollout  # nothing built at reset
        text = [list(p) for p in prompts.tolist()]
        for step in range(24):
            for t in text:
                t.append(int(torch.randint(1, 6, (1,), generator=gen)))
            rows = [r for r in range(6) if (r + step) % 3 or step > 16]  # rows join at different steps
            c = ctx([text[r] for r in rows], rows, [int(groups[r]) for r in rows])
            if step % 2:
                a, b = lazy.propose(c, 3, GREEDY), eager.propose(c, 3, GREEDY)
            else:
                budget = TreeBudget(6, 3, 2)
                a, b = lazy.propose_tree(c, budget, GREEDY), eager.propose_tree(c, budget, GREEDY)
                assert torch.equal(a.parents, b.parents)
            assert torch.equal(a.tokens, b.tokens), (rollout, step)
        comp = torch.tensor([t[5:] for t in text])
        lazy.observe(comp, torch.ones_like(comp), groups)


def test_eagle_cache_matches_one_shot(policy: torch.nn.Module) -> None:
    """Feeding the policy's features in two calls (with drafted entries cropped in between) gives the
    same proposal as feeding them all at once."""
    tokens = [3, 4, 5, 6, 7, 8, 9, 10]
    hidden = torch.randn(1, len(tokens), 32, generator=torch.Generator().manual_seed(0))
    one = EagleDraft(policy)
    two = copy.deepcopy(one)
    two.bind_policy(policy)
    prompts = torch.tensor([tokens[:5]])
    for d in (one, two):
        d.reset(prompts, torch.ones_like(prompts), torch.tensor([0]))
    full = one.propose(ctx([tokens], [0], [0], hidden, torch.tensor([8])), 3, GREEDY)
    two.propose(ctx([tokens[:5]], [0], [0], hidden[:, :5], torch.tensor([5])), 4, GREEDY)
    split = two.propose(ctx([tokens], [0], [0], hidden[:, 5:], torch.tensor([3])), 3, GREEDY)
    assert full.tokens.tolist() == split.tokens.tolist()
    assert full.probs is not None and split.probs is not None
    torch.testing.assert_close(full.probs, split.probs, atol=1e-5, rtol=0)


def _batch(policy: torch.nn.Module) -> DraftTrainingBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 16, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # left padding
    out = policy(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:-1] = 1
    return DraftTrainingBatch(ids, loss_mask, out.hidden_states[-1].detach(), out.logits.detach(), attn)


def test_eagle_online_learning_and_checkpoint(policy: torch.nn.Module) -> None:
    batch = _batch(policy)
    d = EagleDraft(policy, EagleConfig(lr=3e-3, epochs=2))
    with torch.no_grad():
        before = float(d.loss(batch))
    for _ in range(5):
        metrics = d.update(batch)
    with torch.no_grad():
        after = float(d.loss(batch))
    assert after < before
    assert metrics["updates"] == 5.0
    assert all(p.grad is None for p in policy.parameters()), "the draft must not touch the policy's grads"
    state = d.state_dict()
    resumed = EagleDraft(policy, EagleConfig(lr=3e-3, epochs=2, seed=7))
    resumed.load_state_dict(state)
    m1, m2 = d.update(batch), resumed.update(batch)  # same weights + optimizer -> same next step
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    for p, q in zip(d.head.parameters(), resumed.head.parameters()):
        torch.testing.assert_close(p, q)
    with pytest.raises(GRPOPartsError, match="missing"):
        resumed.load_state_dict({"head": state["head"]})


def test_draft_context_validation() -> None:
    t = torch.tensor([[1, 2, 3]])
    with pytest.raises(GRPOPartsError, match="new_hidden/num_new"):
        DraftContext(t, torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), num_new=torch.tensor([1]))
    with pytest.raises(GRPOPartsError, match="num_new"):
        DraftContext(
            t, torch.tensor([3]), torch.tensor([0]), torch.tensor([0]),
            new_hidden=torch.zeros(1, 2, 4), num_new=torch.tensor([3]),
        )  # fmt: skip


def test_ngram_pool_prefers_longest_agreement_then_own_text() -> None:
    """Where the occurrences of the matched suffix disagree on what follows, the one whose earlier
    text agrees longest with the row's wins, then the row's own text, then the most recent."""
    pool = _Pool(1, 2)
    own = pool.add([7, 5, 1, 2, 3, 4, 5, 1])  # the row's previous "line" 5 1 2 3, now at "5 1"
    sibling = pool.add([7, 5, 1, 2, 9])  # more recent, same agreement (5 1 2), different next token
    pool.extend(own, [2])
    tail = pool.seqs[own]
    assert pool.continuation(tail, 2, own) == [3, 4]  # own previous line, not the sibling's 9
    assert pool.continuation(tail, 2) == [9]  # no own row: the most recent on a tie
    # a sibling whose text agrees further back (4 5 1 2) beats the row's own shorter agreement
    pool.add([3, 4, 5, 1, 2, 8])
    assert pool.continuation(tail, 1, own) == [8]
    assert sibling != own
    # every occurrence agreeing on the next token: the most recent one, as before
    solo = _Pool(1, 2)
    a = solo.add([1, 2, 3, 4])
    solo.add([0, 2, 3, 6])
    assert solo.continuation([5, 2], 2, a) == [3, 6]


def test_ngram_draft_proposes_the_rows_own_previous_line() -> None:
    d = NGramDraft(max_ngram=2)
    prompts = torch.tensor([[7, 8], [7, 8]])
    d.reset(prompts, torch.ones_like(prompts), torch.tensor([0, 0]))
    # row 1 (the sibling) wrote its line 5 1 2 with a different term (9) after row 0 wrote 5 1 2 3
    row0, row1 = [7, 8, 5, 1, 2, 3, 4, 5, 1], [7, 8, 5, 1, 2, 9]
    d.propose(ctx([row0, row1], [0, 1], [0, 0]), 1, GREEDY)
    out = d.propose(ctx([row0 + [2]], [0], [0]), 2, GREEDY)
    assert out.tokens[0].tolist() == [3, 4]
