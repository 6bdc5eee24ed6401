"""The lean decode forward (sampler/speculative/lean_forward.py) equals the model's own cached forward, and the
speculative sampler runs it (and says when it does not)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.compat import output_cache, select_attention
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.errors import NotSupportedError
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative.decode_attention import LAYOUT_KWARG, DecodeLayout, register
from grpo_parts.sampler.speculative.lean_forward import LeanForward, lean_forward_for, lean_forward_reasons
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.tiny import family_missing, tiny_causal_lm

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
ROPE = [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}]


def _model(family: str, kv: int, bias: bool, tie: bool, rope: dict | None, seed: int) -> torch.nn.Module:  # type: ignore[type-arg]
    over: dict = {"tie_word_embeddings": tie}  # type: ignore[type-arg]
    if family == "llama":
        over.update(attention_bias=bias, mlp_bias=bias)
    if rope is not None:
        over["rope_scaling"] = {**rope, "rope_theta": 10000.0}
    m = tiny_causal_lm(
        family, vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=kv, head_dim=8,
        seed=seed, dtype=torch.float64, attn_implementation="sdpa", **over,
    )  # fmt: skip
    with torch.no_grad():  # larger logits: differences would show
        m.lm_head.weight.mul_(4.0)
    return m


def _prefill(m: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> object:
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return output_cache(m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True))


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    family=st.sampled_from(FAMILIES),
    kv=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    tie=st.booleans(),
    rope=st.sampled_from(ROPE),
    rows=st.integers(1, 4),
    past=st.integers(1, 9),
    t=st.integers(1, 5),
    holes=st.booleans(),
    tree=st.booleans(),
    seed=st.integers(0, 3),
)
def test_equals_the_models_cached_forward(
    family, kv, bias, tie, rope, rows, past, t, holes, tree, seed
) -> None:  # type: ignore[no-untyped-def]
    """Logits, the last hidden state and the cache after the forward, in float64, against the
    model's own forward on an identical cache: left padding, holes in the cache, a 2-D mask or a
    prepared 4-D (tree) mask."""
    if family_missing(family):
        pytest.skip(family_missing(family))
    m = _model(family, kv, bias, tie, rope, seed)
    assert lean_forward_reasons(m) == []
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 24, (rows, past), generator=g)
    mask = torch.ones(rows, past, dtype=torch.long)
    mask[0, : past // 2] = 0  # left padding
    if holes and past > 2:
        mask[-1, -2] = 0  # a rejected draft token's entry
    with torch.no_grad():
        c_ref, c_lean = _prefill(m, ids, mask), _prefill(m, ids, mask)
        inp = torch.randint(1, 24, (rows, t), generator=g)
        full = torch.cat([mask, torch.ones(rows, t, dtype=torch.long)], 1)
        pos = mask.sum(-1, keepdim=True) + torch.arange(t)
        attn: torch.Tensor = full
        if tree:  # an additive 4-D mask: each new token sees the cache and a random subset of the block
            vis = torch.ones(rows, 1, t, past + t, dtype=torch.bool)
            vis[..., :past] &= mask.bool()[:, None, None, :]
            vis[..., past:] = torch.rand(rows, 1, t, t, generator=g) < 0.6
            vis[..., past:] |= torch.eye(t, dtype=torch.bool)
            attn = torch.zeros(vis.shape, dtype=torch.float64).masked_fill(
                ~vis, torch.finfo(torch.float64).min
            )
        ref = m(
            input_ids=inp, attention_mask=attn, position_ids=pos, past_key_values=c_ref, use_cache=True,
            output_hidden_states=True,
        )  # fmt: skip
        lean = LeanForward(m)
        got = lean(inp, attn, pos, c_lean, need_h=True)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-10, rtol=0)
    assert got.hidden_states is not None
    torch.testing.assert_close(got.hidden_states[-1], ref.hidden_states[-1], atol=1e-10, rtol=0)
    for a, b in zip(c_lean.layers, c_ref.layers, strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(a.keys, b.keys, atol=1e-12, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=1e-12, rtol=0)


def test_under_the_decode_kernel_with_a_layout() -> None:
    """Inside the decode loop the attention is the shared-prompt kernel with its layout: the lean
    forward passes the layout on and equals the model's forward under the same kernel."""
    m = _model("qwen2", 2, False, False, None, 0)
    ids = torch.randint(1, 24, (1, 6)).repeat(4, 1)  # one prompt, 4 rows: the prompt is shared
    mask = torch.ones(4, 6, dtype=torch.long)
    with torch.no_grad(), select_attention(m, register()):
        c_ref, c_lean = _prefill(m, ids, mask), _prefill(m, ids, mask)
        calls: dict[str, int] = {"shared_prefix": 0, "plain": 0, "plain_gqa": 0}
        lay = DecodeLayout.build(torch.zeros(4, dtype=torch.long), 6, calls, always=True)
        inp = torch.randint(1, 24, (4, 3))
        full = torch.ones(4, 9, dtype=torch.long)
        pos = torch.full((4, 1), 6) + torch.arange(3)
        lay.choose(3)
        ref = m(
            input_ids=inp,
            attention_mask=full,
            position_ids=pos,
            past_key_values=c_ref,
            use_cache=True,
            **{LAYOUT_KWARG: lay},
        )
        lean, why = lean_forward_for(m, "auto")
        assert why == [] and lean is not None
        got = lean(inp, full, pos, c_lean, extra={LAYOUT_KWARG: lay})
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-10, rtol=0)
    assert calls["shared_prefix"] == 2 * 2  # two forwards x two layers took the shared path


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sampler_runs_it_and_matches_the_reference(family: str) -> None:
    """Greedy rollouts equal the reference sampler's, every decode forward ran the lean path, and
    with ``lean_forward='off'`` none did."""
    m = _model(family, 2, True, False, None, 1)
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=3, max_new_tokens=12, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(m).generate(prompts, params)
    for mode in ("auto", "off"):
        cfg = SpeculativeConfig(draft_tokens=2, lean_forward=mode)
        spec = SpeculativeSampler(m, NGramDraft(max_ngram=3), cfg)
        out = spec.generate(prompts, params)
        assert torch.equal(out.completion_ids, ref.completion_ids)
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-10, rtol=0)
        lean, own = out.stats["lean_forward_calls"], out.stats["model_forward_calls"]
        assert (lean > 0 and own == 0) if mode == "auto" else (lean == 0 and own > 0)
        assert spec.lean_forward_reasons == ([] if mode == "auto" else ["config: lean_forward='off'"])


def test_sampled_rollouts_are_identical_with_and_without_it() -> None:
    """At temperature 1 with the same generator the lean and the model's forward draw the same
    tokens (same logits): the sampling distribution is untouched."""
    m = _model("llama", 4, False, False, None, 2)
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=4, max_new_tokens=10, temperature=1.0, eos_token_ids=(3,))
    outs = []
    for mode in ("auto", "off"):
        spec = SpeculativeSampler(
            m, NGramDraft(max_ngram=3), SpeculativeConfig(draft_tokens=3, lean_forward=mode)
        )
        outs.append(spec.generate(prompts, params, torch.Generator().manual_seed(7)))
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)
    torch.testing.assert_close(outs[0].logprobs, outs[1].logprobs, atol=1e-10, rtol=0)
    assert outs[0].stats["lean_forward_calls"] > 0 and outs[1].stats["lean_forward_calls"] == 0


def test_refusals_name_the_reason() -> None:
    gemma = tiny_causal_lm("gemma2", vocab_size=8, hidden_size=32, num_layers=2)
    assert "model_type 'gemma2'" in " ".join(lean_forward_reasons(gemma))
    window = tiny_causal_lm("mistral", vocab_size=8, hidden_size=32, num_layers=2, sliding_window=16)
    assert "sliding-window" in " ".join(lean_forward_reasons(window))

    m = tiny_causal_lm("llama", vocab_size=8, hidden_size=32, num_layers=2)
    handle = m.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert "forward hooks on 'model.layers.1.mlp'" in " ".join(lean_forward_reasons(m))
    handle.remove()
    assert lean_forward_reasons(m) == []

    own = m.forward
    m.forward = lambda *a, **k: own(*a, **k)  # a wrapper the lean path does not know
    assert "LlamaForCausalLM.forward is replaced" in " ".join(lean_forward_reasons(m))
    m.forward = torch.autocast("cpu")(own)  # autocast (accelerate's wrapper): reproduced, served
    assert lean_forward_reasons(m) == []
    del m.forward
    assert lean_forward_reasons(m) == []

    class LoraLinear(torch.nn.Linear):  # a wrapped projection: its own forward must run
        pass

    q = m.model.layers[0].self_attn.q_proj
    m.model.layers[0].self_attn.q_proj = LoraLinear(q.in_features, q.out_features, bias=False)
    assert "LoraLinear projection" in " ".join(lean_forward_reasons(m))
    with pytest.raises(NotSupportedError, match="LoraLinear"):
        SpeculativeSampler(m, NGramDraft(), SpeculativeConfig(lean_forward="on"))
    SpeculativeSampler(m, NGramDraft(), SpeculativeConfig(lean_forward="auto"))  # falls back

    eager = tiny_causal_lm("llama", vocab_size=8, hidden_size=32, num_layers=2, attn_implementation="eager")
    lean, why = lean_forward_for(eager, "auto")
    assert lean is None and "attention 'eager'" in " ".join(why)
    with pytest.raises(NotSupportedError, match="eager"):
        lean_forward_for(eager, "on")


def test_eager_policy_rollout_counts_the_models_forward() -> None:
    """A policy the lean path cannot serve decodes through its own forward, counted, and the sampler
    says why."""
    m = tiny_causal_lm("llama", vocab_size=16, hidden_size=32, num_layers=2, attn_implementation="eager")
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=6, temperature=0.0, eos_token_ids=(3,))
    spec = SpeculativeSampler(m, NGramDraft(max_ngram=3), SpeculativeConfig(draft_tokens=2))
    out = spec.generate(prompts, params)
    assert out.stats["lean_forward_calls"] == 0 and out.stats["model_forward_calls"] > 0
    assert any("eager" in r for r in spec.lean_forward_reasons)
