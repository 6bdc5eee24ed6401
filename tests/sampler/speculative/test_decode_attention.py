"""Shared-prompt decode attention (sampler/speculative/decode_attention.py): float64 equivalence with plain
attention on random layouts (groups of different sizes, rows out of group order, holes, tree masks,
GQA, left padding, boolean and additive masks), exact greedy identity of the speculative sampler
with the path active, the prompt columns kept in place by compaction, and the model refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.decoding import compact_cache
from grpo_parts.draft.eagle import EagleDraft
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative.decode_attention import (
    DecodeLayout,
    decode_attention_reasons,
    shared_prompt_attention,
)
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.tiny import tiny_causal_lm


def plain_attention(q, k, v, allowed, scale):  # type: ignore[no-untyped-def]
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    hk=st.integers(1, 2),
    rep=st.integers(1, 2),
    t=st.integers(1, 4),
    p=st.integers(1, 6),
    past=st.integers(0, 5),
    shuffle=st.booleans(),
    additive=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_plain_attention(sizes, hk, rep, t, p, past, shuffle, additive, seed) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    u, d, h = len(sizes), 4, hk * rep
    group = torch.arange(u).repeat_interleave(torch.tensor(sizes))
    if shuffle:
        group = group[torch.randperm(group.numel(), generator=gen)]
    a, n = group.numel(), p + past + t
    q = torch.randn(a, h, t, d, generator=gen, dtype=torch.float64)
    kg = torch.randn(u, hk, p, d, generator=gen, dtype=torch.float64)  # the prompt's K/V per group
    vg = torch.randn(u, hk, p, d + 1, generator=gen, dtype=torch.float64)
    k = torch.cat([kg[group], torch.randn(a, hk, n - p, d, generator=gen, dtype=torch.float64)], 2)
    v = torch.cat([vg[group], torch.randn(a, hk, n - p, d + 1, generator=gen, dtype=torch.float64)], 2)
    pad = torch.randint(0, p, (u,), generator=gen)[group]  # left padding, the same within a group
    allowed = torch.rand(a, 1, t, n, generator=gen) > 0.3  # holes in the past, a tree in the block
    allowed[..., :p] = torch.arange(p)[None, :] >= pad[:, None, None, None]
    allowed[..., -t:] &= torch.ones(t, t, dtype=torch.bool).tril()
    allowed[..., -t:] |= torch.eye(t, dtype=torch.bool)  # every query sees itself
    mask = allowed
    if additive:
        mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
            ~allowed, torch.finfo(torch.float64).min
        )
    lay = DecodeLayout.build(group, p)
    assert lay.dense == (not shuffle or bool((group == group.sort().values).all())) or max(sizes) != min(
        sizes
    )
    got = shared_prompt_attention(q, k, v, mask, lay, 0.37)
    torch.testing.assert_close(got, plain_attention(q, k, v, allowed, 0.37), rtol=1e-12, atol=1e-12)


def test_no_mask_is_causal_over_the_block() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 2, 3, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 4, generator=gen, dtype=torch.float64).repeat_interleave(2, 0)
    v = torch.randn(4, 2, 7, 4, generator=gen, dtype=torch.float64)
    v[:, :, :3] = v[::2, :, :3].repeat_interleave(2, 0)
    allowed = torch.ones(3, 7, dtype=torch.bool).tril(4)
    got = shared_prompt_attention(q, k, v, None, DecodeLayout.build(torch.tensor([0, 0, 1, 1]), 3), 0.5)
    torch.testing.assert_close(got, plain_attention(q, k, v, allowed, 0.5), rtol=1e-12, atol=1e-12)


def test_the_per_forward_mask_cache_keys_on_both_block_sizes() -> None:
    """Two mask-less forwards (causal over the block) with the same cache length but different
    query lengths must not share the converted mask (a 1-token step after a crop can meet the
    width an earlier verification had)."""
    gen = torch.Generator().manual_seed(1)
    lay = DecodeLayout.build(torch.tensor([0, 0, 1, 1]), 3)
    k = torch.randn(2, 2, 7, 4, generator=gen, dtype=torch.float64).repeat_interleave(2, 0)
    v = torch.randn(2, 2, 7, 4, generator=gen, dtype=torch.float64).repeat_interleave(2, 0)
    for t in (1, 3):
        q = torch.randn(4, 2, t, 4, generator=gen, dtype=torch.float64)
        allowed = torch.ones(t, 7, dtype=torch.bool).tril(7 - t)
        got = shared_prompt_attention(q, k, v, None, lay, 0.5)
        torch.testing.assert_close(got, plain_attention(q, k, v, allowed, 0.5), rtol=1e-12, atol=1e-12)


def test_compaction_keeps_the_prompt_columns() -> None:
    from transformers import DynamicCache

    m = tiny_causal_lm("llama", vocab_size=16, hidden_size=16, num_layers=1, dtype=torch.float64)
    cache = DynamicCache()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    m(input_ids=ids, past_key_values=cache, use_cache=True)
    keys = cache.layers[0].keys.clone()
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]])
    new = compact_cache(cache, mask, start=3)
    assert new is not None
    assert torch.equal(new, torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 1, 1]]))  # the prompt's mask as it was
    assert torch.equal(cache.layers[0].keys[:, :, :3], keys[:, :, :3])
    assert torch.equal(cache.layers[0].keys[0, :, 4], keys[0, :, 4])
    assert torch.equal(cache.layers[0].keys[1, :, 3:], keys[1, :, [3, 5]])


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2, 5], [3]]


def _policy(attn: str) -> torch.nn.Module:
    m = tiny_causal_lm(
        "llama", vocab_size=8, hidden_size=32, num_layers=2, num_kv_heads=2, seed=0, attn_implementation=attn
    )
    with torch.no_grad():
        m.lm_head.weight.mul_(12.0)
    return m


@pytest.mark.parametrize(
    ("attn", "draft", "nodes"),
    [("sdpa", "ngram", None), ("eager", "ngram", None), ("sdpa", "eagle", None), ("sdpa", "ngram", 4)],
)
def test_greedy_identity_with_the_shared_path(attn: str, draft: str, nodes: int | None) -> None:
    policy = _policy(attn)
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=3, max_new_tokens=15, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    cfg = SpeculativeConfig(
        draft_tokens=3, tree_nodes=nodes, compact_waste=0.2, decode_shared_prompt="always"
    )
    d = NGramDraft(max_ngram=3) if draft == "ngram" else EagleDraft(policy)
    spec = SpeculativeSampler(policy, d, cfg)  # type: ignore[arg-type]
    assert spec.decode_attention_reasons(params) == []
    for _ in range(2):
        out = spec.generate(prompts, params)
        assert torch.equal(out.completion_ids, ref.completion_ids)
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        assert out.stats["decode_attention_shared_prefix_calls"] > 0
        assert out.stats["decode_attention_plain_calls"] == 0
    assert policy.config._attn_implementation == attn  # restored after the rollout
    assert len(set(ref.completion_lengths().tolist())) > 1


def test_auto_counts_both_paths_and_off_neither() -> None:
    policy = _policy("sdpa")
    prompts = PromptBatch.from_lists(PROMPTS * 4, pad_token_id=0)
    params = SamplingParams(group_size=8, max_new_tokens=12, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    for mode in ("auto", "off"):
        cfg = SpeculativeConfig(draft_tokens=1, decode_shared_prompt=mode)
        out = SpeculativeSampler(policy, NGramDraft(max_ngram=3), cfg).generate(prompts, params)
        assert torch.equal(out.completion_ids, ref.completion_ids)
        shared, plain = (
            out.stats["decode_attention_shared_prefix_calls"],
            out.stats["decode_attention_plain_calls"],
        )
        assert (shared > 0 and plain > 0) if mode == "auto" else (shared == plain == 0)


def test_refusals() -> None:
    assert decode_attention_reasons(_policy("sdpa"), 4) == []
    assert any("group_size 1" in r for r in decode_attention_reasons(_policy("sdpa"), 1))
    gemma = tiny_causal_lm("gemma2", vocab_size=8, hidden_size=32, num_layers=2)
    why = " ".join(decode_attention_reasons(gemma, 4))
    assert "sliding-window" in why and "soft-capping" in why
