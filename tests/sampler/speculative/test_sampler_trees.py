"""Draft trees: exact greedy identity with the reference sampler and log-probs equal to a plain
forward for every draft (hypothesis: batch 1-16, rows finishing at different steps, EOS inside a
branch); chi-square losslessness with every draft at temperatures 1.0 and 0.7, top-k and top-p,
EOS and ``max_new_tokens`` inside a branch (sample-then-match for n-gram / frozen-LM trees,
recursive rejection sampling for the EAGLE / small-LM trees of sampled children); a broken tree
verifier and a wrong recursive rejection sampler must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import rrs_without_q_update, tree_always_accept

from grpo_parts.decoding import tree_ancestors, tree_attention_mask
from grpo_parts.draft.eagle import EagleDraft
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.draft.protocol import DraftProposal, TreeBudget, TreeDraftModel
from grpo_parts.draft.reference import FrozenLMDraft
from grpo_parts.draft.small_lm import CachedLMDraft
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.testing import chi_square_gof, sequence_distribution
from grpo_parts.tiny import tiny_causal_lm

from .test_sampler import plain_logprobs

V = 8
DRAFTS = ["frozen_lm", "small_lm", "ngram", "eagle"]


def _lm(seed: int, layers: int, scale: float, attn: str | None = None) -> torch.nn.Module:
    m = tiny_causal_lm(
        "qwen2", vocab_size=V, hidden_size=32, num_layers=layers, seed=seed, attn_implementation=attn
    )
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return m


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return _lm(0, 2, 12.0)


def make_draft(name: str, policy: torch.nn.Module) -> TreeDraftModel:
    if name == "frozen_lm":
        return FrozenLMDraft(_lm(1, 1, 12.0))
    if name == "small_lm":
        return CachedLMDraft(_lm(1, 1, 12.0))
    if name == "ngram":
        return NGramDraft(max_ngram=3)
    return EagleDraft(policy)


def test_proposal_validates_parents() -> None:
    with pytest.raises(ValueError, match="parents"):
        DraftProposal(torch.tensor([[1, 2]]), None, torch.tensor([[0, -1]]))  # node 0 cannot hang from itself
    chain = DraftProposal(torch.tensor([[1, 2, 3]]))
    assert chain.chain_parents().tolist() == [[-1, 0, 1]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_forward_equals_each_branch_alone(attn: str) -> None:
    """One cached forward of a tree under the tree mask gives every node the logits a plain forward
    of its own branch gives (eager and SDPA kernels, left padding and holes in the cache)."""
    model = _lm(2, 2, 1.0, attn)
    ctx = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    cmask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 1, 1]])  # left padding; a hole in row 1
    pos = (cmask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ctx, attention_mask=cmask, position_ids=pos, use_cache=True)
    tokens = torch.tensor([[1, 2, 3, 4], [6, 6, 2, 1]])
    parents = torch.tensor([[-1, -1, 0, 2], [-1, 0, 0, 1]])
    anc = tree_ancestors(parents)
    depth = anc.sum(-1) - 1
    root = torch.tensor([[3], [4]])
    inp = torch.cat([root, tokens], 1)
    am = tree_attention_mask(cmask, anc, torch.float32)
    tree = model(
        input_ids=inp, attention_mask=am, position_ids=cmask.sum(-1, keepdim=True) + depth,
        past_key_values=out.past_key_values, use_cache=True,
    ).logits  # fmt: skip
    for a in range(2):
        real = ctx[a][cmask[a].bool()]
        for col in range(5):
            branch = inp[a][anc[a, col]]  # ancestors-or-self in order (root first)
            ids = torch.cat([real, branch])[None]
            want = model(input_ids=ids).logits[0, -1]
            torch.testing.assert_close(tree[a, col], want, atol=1e-5, rtol=0)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    draft=st.sampled_from(DRAFTS),
    prompts=st.lists(st.lists(st.integers(1, V - 1), min_size=1, max_size=5), min_size=1, max_size=8),
    group=st.sampled_from([1, 2]),
    nodes=st.sampled_from([1, 3, 6, 12]),
    eos=st.sampled_from([(), (3,), (2, 5)]),
    tmax=st.integers(1, 14),
)
def test_greedy_identity_and_logprobs(policy, draft, prompts, group, nodes, eos, tmax) -> None:  # type: ignore[no-untyped-def]
    """Batch 1-16, EOS and max_new_tokens anywhere (inside branches too): token-for-token the
    reference sampler's greedy output, log-probs of a plain forward."""
    batch = PromptBatch.from_lists(prompts, pad_token_id=0)
    params = SamplingParams(group_size=group, max_new_tokens=tmax, temperature=0.0, eos_token_ids=eos)
    ref = ReferenceSampler(policy).generate(batch, params)
    cfg = SpeculativeConfig(tree_nodes=nodes, compact_waste=0.3, train_draft=False)
    spec = SpeculativeSampler(policy, make_draft(draft, policy), cfg)
    for _ in range(2):  # second rollout: history drafts have state
        out = spec.generate(batch, params)
        assert torch.equal(out.completion_ids, ref.completion_ids)
        assert torch.equal(out.completion_mask, ref.completion_mask)
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    if tmax > 1:
        assert out.stats["tree_steps"] > 0


@pytest.mark.parametrize("draft", DRAFTS)
def test_sampled_logprobs_equal_plain_forward(policy: torch.nn.Module, draft: str) -> None:
    prompts = PromptBatch.from_lists([[1, 2, 3], [4, 5], [6, 7, 1, 2, 5], [3]], pad_token_id=0)
    params = SamplingParams(group_size=3, max_new_tokens=12, temperature=0.7, top_p=0.9, eos_token_ids=(3,))
    spec = SpeculativeSampler(policy, make_draft(draft, policy), SpeculativeConfig(tree_nodes=8))
    out = spec.generate(prompts, params, torch.Generator().manual_seed(0))
    assert out.stats["tree_steps"] > 0
    assert len(set(out.completion_lengths().tolist())) > 1  # rows finished at different steps
    torch.testing.assert_close(out.logprobs, plain_logprobs(policy, out, 0.7), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- losslessness (chi-square)
SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7": dict(temperature=0.7),
    "t0.7_p0.9": dict(temperature=0.7, top_p=0.9),
    "topk3": dict(temperature=1.0, top_k=3),
}
PROMPT = [1, 5, 2]
N_SAMPLES = 2000
LENGTH = 4  # max_new_tokens: trees of depth >= 3 reach past it (max_new_tokens inside a branch)
EOS = 6  # a likely token under this policy: EOS inside a branch stops the row there


def _exact(policy: torch.nn.Module, setting: str, eos: int | None) -> dict[tuple[int, ...], float]:
    """Exact distribution of the completion, cut after the first EOS (later tokens: -1)."""
    s = SETTINGS[setting]
    probs = sequence_distribution(
        policy, PROMPT, LENGTH, s["temperature"], s.get("top_k", 0), s.get("top_p", 1.0)
    )
    seqs = np.stack(np.unravel_index(np.arange(V**LENGTH), [V] * LENGTH), 1)  # row-major: first token slowest
    out: dict[tuple[int, ...], float] = {}
    for seq, p in zip(seqs.tolist(), probs.tolist()):
        key = tuple(_cut(seq, eos))
        out[key] = out.get(key, 0.0) + p
    return out


def _cut(seq: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in seq:
        i = seq.index(eos) + 1
        return seq[:i] + [-1] * (len(seq) - i)
    return seq


def _sample(policy, draft, setting, eos, verifier=None, nodes=6, sampled_verifier=None):  # type: ignore[no-untyped-def]
    params = SamplingParams(
        group_size=N_SAMPLES,
        max_new_tokens=LENGTH,
        eos_token_ids=() if eos is None else (eos,),
        **SETTINGS[setting],
    )
    kw = {} if verifier is None else {"tree_verifier": verifier}
    if sampled_verifier is not None:
        kw["sampled_tree_verifier"] = sampled_verifier
    cfg = SpeculativeConfig(tree_nodes=nodes, train_draft=False, tree_min_depth=3)
    spec = SpeculativeSampler(policy, make_draft(draft, policy), cfg, **kw)
    out = spec.generate(
        PromptBatch.from_lists([PROMPT], pad_token_id=0), params, torch.Generator().manual_seed(7)
    )
    assert out.stats["tree_steps"] > 0
    # the drafts with probabilities draw their children (recursive rejection sampling ran); the
    # others propose point masses, verified by sample-then-match
    sampled = draft in ("eagle", "small_lm")
    assert (out.stats["sampled_tree_steps"] > 0) == sampled
    if sampled:
        assert out.stats["sampled_tree_steps"] == out.stats["tree_steps"]
    comp = torch.full((N_SAMPLES, LENGTH), -1, dtype=torch.long)
    t = out.completion_ids.shape[1]
    comp[:, :t] = out.completion_ids.masked_fill(out.completion_mask == 0, -1)
    return [tuple(r) for r in comp.tolist()]


def _p_value(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    assert all(s in index for s in samples), "a sample the policy cannot produce"
    codes = np.array([index[s] for s in samples])
    return chi_square_gof(codes, np.array([exact[k] for k in keys]))


CASES = [  # every draft; temperatures 1.0 and 0.7, top-k, top-p; EOS inside branches
    ("frozen_lm", "topk3", EOS),
    ("small_lm", "t0.7", EOS),
    ("ngram", "t0.7_p0.9", EOS),
    ("eagle", "t1", EOS),
    pytest.param("eagle", "topk3", None, marks=pytest.mark.slow),
    pytest.param("ngram", "t1", None, marks=pytest.mark.slow),
    pytest.param("small_lm", "t0.7_p0.9", None, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("draft", "setting", "eos"), CASES)
def test_tree_lossless_chi_square(policy: torch.nn.Module, draft: str, setting: str, eos: int | None) -> None:
    exact = _exact(policy, setting, eos)
    samples = _sample(policy, draft, setting, eos)
    assert _p_value(samples, exact) > 1e-4
    if eos is not None:
        assert any(-1 in s for s in samples), "EOS must stop some rows early for this case to bite"


@pytest.mark.parametrize(
    ("draft", "setting"), [("ngram", "t0.7_p0.9"), pytest.param("frozen_lm", "t1", marks=pytest.mark.slow)]
)
def test_broken_tree_verifier_fails(policy: torch.nn.Module, draft: str, setting: str) -> None:
    samples = _sample(policy, draft, setting, None, verifier=tree_always_accept)
    assert _p_value(samples, _exact(policy, setting, None)) < 1e-6


@pytest.mark.parametrize("draft", ["eagle", pytest.param("small_lm", marks=pytest.mark.slow)])
def test_wrong_rrs_fails(policy: torch.nn.Module, draft: str) -> None:
    """EAGLE / small-LM trees are sampled (recursive rejection sampling verifies them): a variant
    that does not renormalize ``q`` after a rejected child must fail."""
    samples = _sample(policy, draft, "t1", None, sampled_verifier=rrs_without_q_update)
    assert _p_value(samples, _exact(policy, "t1", None)) < 1e-6


def test_budget_split_follows_fastgrpo() -> None:
    cfg = SpeculativeConfig()
    assert cfg.tree_budget(2) == TreeBudget(2, 2, 1)
    assert cfg.tree_budget(8) == TreeBudget(8, 3, 7)
    assert cfg.tree_budget(32) == TreeBudget(32, 5, 8)
