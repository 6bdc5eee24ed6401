"""The decode attention's grouped path (sampler/speculative/decode_attention.py, ``grouped_query_attention``):
float64 equivalence with plain attention (GQA, left padding, holes, tree blocks, boolean, additive
and per-head masks, no mask), and exact greedy identity of the speculative sampler with the
reference sampler where it serves the decode forwards (counted in ``Rollout.stats``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative.decode_attention import DecodeLayout, grouped_query_attention
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.tiny import tiny_causal_lm

from .test_decode_attention import plain_attention  # the float64 reference both kernels are checked against


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    a=st.integers(1, 5),
    hk=st.integers(1, 3),
    rep=st.integers(1, 3),
    t=st.integers(1, 4),
    n_past=st.integers(1, 8),
    kind=st.sampled_from(["bool", "additive", "per_head", "none"]),
    seed=st.integers(0, 2**16),
)
def test_matches_plain_attention(a, hk, rep, t, n_past, kind, seed) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    h, d, n = hk * rep, 4, n_past + t
    q = torch.randn(a, h, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(a, hk, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(a, hk, n, d + 1, generator=gen, dtype=torch.float64)
    pad = torch.randint(0, n_past, (a,), generator=gen)  # left padding
    allowed = torch.rand(a, 1, t, n, generator=gen) > 0.3  # holes in the past, a tree in the block
    allowed[..., : n - t] &= torch.arange(n - t)[None, :] >= pad[:, None, None, None]
    allowed[..., -t:] &= torch.ones(t, t, dtype=torch.bool).tril()
    allowed[..., -t:] |= torch.eye(t, dtype=torch.bool)  # every query sees itself
    if kind == "per_head":
        allowed = allowed.repeat(1, h, 1, 1) & (torch.rand(a, h, t, n, generator=gen) > 0.2)
        allowed[..., -t:] |= torch.eye(t, dtype=torch.bool)
    if kind == "none":
        allowed = torch.ones(t, n, dtype=torch.bool).tril(n - t).expand(a, 1, t, n)
    mask: torch.Tensor | None = allowed
    if kind == "additive":
        mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
            ~allowed, torch.finfo(torch.float64).min
        )
    elif kind == "none":
        mask = None
    lay = DecodeLayout.build(torch.zeros(a, dtype=torch.long), 0)
    for _ in range(2):  # the second call reuses the folded mask
        got = grouped_query_attention(q, k, v, mask, lay, 0.37)
        torch.testing.assert_close(got, plain_attention(q, k, v, allowed, 0.37), rtol=1e-12, atol=1e-12)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2, 5], [3]]


def _policy(attn: str, kv_heads: int) -> torch.nn.Module:
    m = tiny_causal_lm(
        "llama", vocab_size=8, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads, seed=0,
        attn_implementation=attn,
    )  # fmt: skip
    with torch.no_grad():
        m.lm_head.weight.mul_(12.0)
    return m


@pytest.mark.parametrize(
    ("attn", "group", "k", "nodes"),
    [
        ("sdpa", 3, 0, None),
        ("eager", 3, 0, None),
        ("sdpa", 1, 0, None),
        ("sdpa", 3, 3, None),
        ("sdpa", 2, 3, 4),
    ],
)
def test_greedy_identity_with_the_grouped_path(attn: str, group: int, k: int, nodes: int | None) -> None:
    """Speculation off (k=0: every forward a plain step) and on (chains, trees): the same tokens
    as the reference sampler, and the grouped path served every decode attention call."""
    policy = _policy(attn, 2)
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=group, max_new_tokens=15, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    cfg = SpeculativeConfig(draft_tokens=k, tree_nodes=nodes, compact_waste=0.2)
    spec = SpeculativeSampler(policy, NGramDraft(max_ngram=3), cfg)
    out = spec.generate(prompts, params)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert out.stats["decode_attention_plain_gqa_calls"] > 0
    assert out.stats["decode_attention_plain_gqa_calls"] == out.stats["decode_attention_plain_calls"]
    assert policy.config._attn_implementation == attn  # restored after the rollout
    assert len(set(ref.completion_lengths().tolist())) > 1  # rows left the batch at different steps


@pytest.mark.parametrize(("kv_heads", "mode"), [(4, "auto"), (2, "off")])
def test_not_used_without_gqa_or_when_off(kv_heads: int, mode: str) -> None:
    policy = _policy("sdpa", kv_heads)
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=8, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    cfg = SpeculativeConfig(draft_tokens=0, decode_shared_prompt=mode)
    out = SpeculativeSampler(policy, NGramDraft(max_ngram=3), cfg).generate(prompts, params)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert out.stats["decode_attention_plain_gqa_calls"] == 0
    assert (out.stats["decode_attention_plain_calls"] > 0) == (mode == "auto")
