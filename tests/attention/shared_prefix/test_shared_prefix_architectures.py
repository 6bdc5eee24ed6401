"""The architecture classes that need more than the attention kernel (issue 25), float64 against the
live reference: multi-head latent attention (value head size != query/key head size: DeepSeek-V2/V3,
MiniCPM3), RoPE whose frequencies follow the forward's largest position id (``longrope``: Phi-3.5 /
Phi-4-mini / PhiMoE; ``dynamic`` NTK: llama), and learned absolute positions up to the context limit
(GPT-2, GPT-BigCode). Each is exact or refused with a specific reason, never a silent difference and
never another exception; and whatever the layout breaks inside a model is a ``NotSupportedError``."""

from __future__ import annotations

import pytest
import torch
from _attention_helpers import VARIANTS, exact_model, random_batch, variant_family
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shared_prefix import ATOL, TOL_FP32_ROUTER, assert_equivalent

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.chunking import chunk_plan
from grpo_parts.attention.shared_prefix.facts import GroupFacts
from grpo_parts.attention.shared_prefix.layout import build_grouped_inputs
from grpo_parts.compat import transformers_version
from grpo_parts.errors import NotSupportedError
from grpo_parts.tiny import family_missing

MLA = ("deepseek_v2", "deepseek_v3", "minicpm3_like")
POSITIONS = ("phi3_longrope", "phimoe_longrope", "llama_dynamic", "gpt2_context", "gpt_bigcode_context")


def refusal(name: str) -> str | None:
    """What the refusal of ``name`` says under the installed transformers (None: exact)."""
    family = variant_family(name)
    if transformers_version() < (5, 0):
        if family == "phimoe":  # 4.x PhimoeRotaryEmbedding(x, seq_len): cos/sin follow the row length
            return "takes no position_ids"
        if family == "gpt2":
            return "ran without the shared-prefix layout"
        if family == "gpt_bigcode":
            return "no logits_to_keep argument"
    return None


def model_kwargs(name: str) -> dict:  # type: ignore[type-arg]
    if variant_family(name) == "deepseek_v3" and transformers_version() < (5, 0):
        # 4.x DeepSeek-V3 MoE accumulates experts in float32 (index_add_ fails in float64): dense layers
        return {"first_k_dense_replace": 8}
    return {}


def tolerance(name: str) -> tuple[float, float]:
    """DeepSeek-V2/V3 route experts in float32 in every release (``F.linear`` on ``.float()``), and V2
    (so MiniCPM3-like) rotates q/k in float32 (``view_as_complex(x.float())``): float64 differences at
    1e-16 then round apart to ~1e-8 relative, where a wrong layout is off by > 1e-3."""
    return TOL_FP32_ROUTER if name in MLA else (ATOL, 0.0)


RUNNABLE = [n for n in (*MLA, *POSITIONS) if family_missing(variant_family(n)) is None and refusal(n) is None]


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    name = draw(st.sampled_from(RUNNABLE))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    shape = dict(hidden_size=heads * head_dim, num_heads=heads, num_kv_heads=kv, head_dim=head_dim)
    if name in MLA:  # q/k head (nope + rope) and v head sizes drawn apart, v smaller or larger
        shape = dict(
            hidden_size=heads * 8,
            num_heads=heads,
            num_kv_heads=heads,
            qk_rope_head_dim=head_dim,
            v_head_dim=draw(st.sampled_from([4, 6, 16])),
        )
    return dict(
        name=name,
        shape=shape,
        layers=draw(st.integers(1, 2)),
        groups=draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)),
        max_prompt=draw(st.integers(1, 6)),
        max_completion=draw(st.integers(1, 6)),
        kernel=draw(st.sampled_from(["sdpa", "eager"])),
        seed=draw(st.integers(0, 2**16)),
        chunks=draw(st.sampled_from([{}, {"max_chunks": 2, "chunk_overhead_tokens": -1},
                                     {"max_chunks": 8, "chunk_overhead_tokens": -1}])),
    )  # fmt: skip


@settings(max_examples=24, derandomize=True, deadline=None)
@given(case=cases())
def test_equivalent_to_reference(case):  # type: ignore[no-untyped-def]
    """Log-probs, entropies and every gradient of a GRPO loss == the reference (several grids too)."""
    name = case["name"]
    model = exact_model(
        name,
        vocab_size=48,
        num_layers=case["layers"],
        seed=case["seed"],
        **case["shape"],
        **model_kwargs(name),
    )
    gen = torch.Generator().manual_seed(case["seed"])
    batch = random_batch(gen, case["groups"], vocab=48, max_prompt=case["max_prompt"],
                         max_completion=case["max_completion"], max_total=VARIANTS.get(name, (0, 0, None))[2])  # fmt: skip
    assert_equivalent(model, batch, case["kernel"], tol=tolerance(name), **case["chunks"])


def variant_batch(name: str, max_completion: int = 6) -> LogprobBatch:
    """Groups of 3, 1 and 2 rows (seeded), no longer than variant ``name``'s context."""
    return random_batch(
        torch.Generator().manual_seed(3),
        [3, 1, 2],
        vocab=48,
        max_prompt=6,
        max_completion=max_completion,
        max_total=VARIANTS.get(name, (0, 0, None))[2],
    )


@pytest.mark.parametrize("name", [*MLA, *POSITIONS])
def test_every_class(name):  # type: ignore[no-untyped-def]
    """Each class with each kernel (flex: no grad), or its specific refusal."""
    if family_missing(variant_family(name)):
        pytest.skip(family_missing(variant_family(name)))
    model = exact_model(
        name,
        vocab_size=48,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4 if name in MLA else 2,
        **model_kwargs(name),
    )
    batch = variant_batch(name)
    why = refusal(name)
    if why is not None:
        assert any(why in r for r in SharedPrefixAttention().not_supported_reasons(model, batch))
        for kernel in ("sdpa", "eager"):
            with pytest.raises(NotSupportedError, match=why):
                SharedPrefixAttention(kernel).completion_logprobs(model, batch)
        return
    assert SharedPrefixAttention().not_supported_reasons(model, batch) == []
    for kernel in ("sdpa", "eager"):
        assert_equivalent(model, batch, kernel, tol=tolerance(name))
    with torch.no_grad():
        ref = RepeatedPrefixAttention().completion_logprobs(model, batch).logprobs
        out = SharedPrefixAttention("flex").completion_logprobs(model, batch).logprobs
    torch.testing.assert_close(out, ref, atol=tolerance(name)[0], rtol=tolerance(name)[1])


def _crossing_batch() -> LogprobBatch:
    """Rows of at most 8 tokens whose one grid would reach position 11: a 6-token prompt with short
    completions and a 2-token prompt with a 6-token completion."""
    p = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 8]])
    c = torch.tensor([[9, 0, 0, 0, 0, 0], [9, 10, 0, 0, 0, 0], [11, 12, 13, 14, 15, 16]])
    return LogprobBatch(p, (p != 0).long(), c, (c != 0).long(), torch.tensor([0, 0, 1]))


@pytest.mark.parametrize("name", ["llama_dynamic", "gpt2_context", "phi3_longrope"])
def test_positions_at_the_context_limit(name):  # type: ignore[no-untyped-def]
    """The batch that took GPT-2 past its position table (IndexError) and llama's dynamic NTK past
    its threshold (silently different) with one grid or a split."""
    if refusal(name) is not None or family_missing(variant_family(name)):
        pytest.skip(f"{name} refused or missing here")
    model = exact_model(name, vocab_size=48)
    for options in ({}, {"max_chunks": 2, "chunk_overhead_tokens": -1}):
        assert_equivalent(model, _crossing_batch(), "sdpa", **options)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    groups=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    max_prompt=st.integers(1, 6),
    max_completion=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    max_chunks=st.sampled_from([1, 2, 8]),
)
def test_grid_positions_are_the_references(groups, max_prompt, max_completion, seed, max_chunks):  # type: ignore[no-untyped-def]
    """Every grid (one or a split) holds only position ids the reference gives, and its largest is
    the reference's largest for the whole batch; real tokens keep their own."""
    batch = random_batch(torch.Generator().manual_seed(seed), groups, vocab=48, max_prompt=max_prompt,
                         max_completion=max_completion)  # fmt: skip
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    ref_pos = (mask.cumsum(-1) - 1).clamp(min=0)
    top = int(ref_pos.max())
    chunks, _ = chunk_plan(GroupFacts.of(batch), -1, max_chunks)
    for rows in chunks:
        grouped = build_grouped_inputs(batch.select(rows), max_position=top)
        assert int(grouped.position_ids.max()) == top
        assert set(grouped.position_ids.unique().tolist()) <= set(ref_pos.unique().tolist())


def test_model_exceptions_become_refusals(monkeypatch):  # type: ignore[no-untyped-def]
    """Any exception a model raises under the layout is a NotSupportedError naming the architecture
    and the cause, from completion_logprobs and (through the probe) not_supported_reasons alike."""
    model = exact_model("llama", vocab_size=48)
    mlp = model.model.layers[0].mlp

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("shape '[1, 4, 1, 1, 12]' is invalid")

    monkeypatch.setattr(mlp, "forward", broken)
    batch = random_batch(torch.Generator().manual_seed(0), [2], vocab=48, max_prompt=3, max_completion=3)
    expected = r"LlamaForCausalLM \(llama\) failed under the shared-prefix layout: RuntimeError: shape"
    with pytest.raises(NotSupportedError, match=expected):
        SharedPrefixAttention("sdpa").completion_logprobs(model, batch)
    assert any(
        "failed under the shared-prefix layout" in r
        for r in SharedPrefixAttention().not_supported_reasons(model)
    )


def test_rotary_classes_are_inspected(monkeypatch):  # type: ignore[no-untyped-def]
    """A rope type that might follow the row length is refused up front, naming the module."""
    model = exact_model("llama", vocab_size=48)
    monkeypatch.setattr(model.model.rotary_emb, "rope_type", "my_length_scaled_rope")
    reasons = SharedPrefixAttention().not_supported_reasons(model)
    assert any(
        "model.rotary_emb (LlamaRotaryEmbedding) has rope_type ['my_length_scaled_rope']" in r
        for r in reasons
    )


@pytest.mark.parametrize(
    ("family", "attn", "over"),
    [
        (
            "gemma2",
            "eager",
            {"attn_logit_softcapping": 50.0, "sliding_window": 3},
        ),  # soft-capping, local layers
        ("mistral", "sdpa", {"sliding_window": 3}),
        ("qwen2", "sdpa", {}),
    ],
)
def test_forward_without_layout_runs_the_models_own_attention(family, attn, over):  # type: ignore[no-untyped-def]
    """While the shared-prefix kernel stays selected (TRL's training_step, verl's engine), a forward
    without the layout -- generation, evaluation -- is the model's own attention, bit for bit."""
    from grpo_parts.attention.shared_prefix.run import KERNEL_NAME, register_attention
    from grpo_parts.compat import select_attention
    from grpo_parts.tiny import tiny_causal_lm

    register_attention()
    model = tiny_causal_lm(family, vocab_size=48, attn_implementation=attn, **over)
    ids = torch.randint(1, 48, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    gen = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        ref_gen = model.generate(ids, **gen)
        with select_attention(model, KERNEL_NAME):
            assert model.config._attn_implementation == KERNEL_NAME
            out = model(input_ids=ids, attention_mask=mask).logits
            out_gen = model.generate(ids, **gen)
    assert torch.equal(out[mask.bool()], ref[mask.bool()])
    assert torch.equal(out_gen, ref_gen)
    assert model.config._attn_implementation == attn


def test_learned_position_tables_are_inspected():  # type: ignore[no-untyped-def]
    """A learned position table shorter than a row is refused with its size, never indexed past."""
    if refusal("gpt2_context") is not None:
        pytest.skip("gpt2 refused here")
    model = exact_model("gpt2", vocab_size=48)
    model.transformer.wpe = torch.nn.Embedding(6, model.config.hidden_size, dtype=torch.float64)
    batch = _crossing_batch()  # rows of 7 and 8 tokens
    expected = "model: learned position table transformer.wpe holds 6 positions; the longest row needs 8"
    assert expected in SharedPrefixAttention().not_supported_reasons(model, batch)
    with pytest.raises(NotSupportedError, match=expected):
        SharedPrefixAttention().completion_logprobs(model, batch)
