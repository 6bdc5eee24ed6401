"""No architecture computes wrong numbers silently: a decoder layer that does not hand the layout to
its attention, a model that builds its own attention bias (ALiBi), a token mixer that is not
attention, an attention keyword the kernel does not implement -- each is a NotSupportedError. Also
attention sinks (exact in the eager kernel) and the kernel's autocast cast."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from _attention_helpers import exact_model, random_batch

import grpo_parts.attention.shared_prefix.run as run_module
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.kernels import shared_prefix_attention
from grpo_parts.attention.shared_prefix.layout import LAYOUT_KWARG, LayoutSettings, build_grouped_inputs
from grpo_parts.attention.shared_prefix.run import KERNEL_NAME, register_attention
from grpo_parts.errors import NotSupportedError
from grpo_parts.tiny import tiny_causal_lm

ATOL = 1e-10


def _batch(seed: int = 0, groups=(3, 2), max_prompt: int = 5, max_completion: int = 4):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    return random_batch(gen, list(groups), vocab=48, max_prompt=max_prompt, max_completion=max_completion)


def _kwargs_dropping_layer(model: torch.nn.Module, i: int) -> None:
    """Make decoder layer ``i`` call its attention without the extra keyword arguments (as e.g.
    StableLM's layer does): only the arguments it names reach ``self_attn``."""
    layer = model.model.layers[i]
    named = ("attention_mask", "position_ids", "position_embeddings", "cache_position", "use_cache")

    class KwargsDroppingLayer(type(layer)):  # type: ignore[misc]
        def forward(self, hidden_states, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super().forward(hidden_states, *args, **{k: v for k, v in kwargs.items() if k in named})

    layer.__class__ = KwargsDroppingLayer


def test_layer_dropping_kwargs_is_refused(monkeypatch):  # type: ignore[no-untyped-def]
    model = exact_model("llama", vocab_size=48, num_layers=3)
    _kwargs_dropping_layer(model, 1)
    batch = _batch()
    refusal = (
        r"LlamaForCausalLM: layer 1 \(model\.layers\.1, KwargsDroppingLayer\) ran without the shared-prefix"
    )
    reasons = SharedPrefixAttention().not_supported_reasons(model, batch)  # the one-token probe
    assert len(reasons) == 1 and "1 of 3 layers without it" in reasons[0], reasons
    with pytest.raises(NotSupportedError, match=refusal):  # and the check after every forward
        SharedPrefixAttention().completion_logprobs(model, batch)
    # what the guard prevents: without it the numbers are wrong, with no error
    monkeypatch.setattr(run_module, "layout_shortfall", lambda model, receipts: [])
    wrong = SharedPrefixAttention().completion_logprobs(model, batch).logprobs
    ref = RepeatedPrefixAttention().completion_logprobs(model, batch).logprobs
    assert (wrong - ref).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("family", "overrides", "refusal"),
    [
        # a decoder layer that does not pass attention keyword arguments on (all releases in range)
        (
            "stablelm",
            {},
            r"StableLmForCausalLM: layer 0 \(model\.layers\.0, StableLmDecoderLayer\) ran without",
        ),
        # attention computed in the model's own code, not through AttentionInterface
        ("falcon", {}, r"FalconForCausalLM: layer 0 \(transformer\.h\.0, FalconDecoderLayer\) ran without"),
        ("falcon", {"alibi": True}, "ALiBi"),
        ("bloom", {}, "ALiBi"),
        ("mpt", {}, "ALiBi"),
        ("lfm2", {}, r"layer types \['conv'\]"),  # a short-convolution token mixer
    ],
)
def test_unsupported_architectures_are_refused(family, overrides, refusal):  # type: ignore[no-untyped-def]
    model = tiny_causal_lm(family, vocab_size=48, num_kv_heads=2, dtype=torch.float64, **overrides)
    batch = _batch()
    assert any(re.search(refusal, r) for r in SharedPrefixAttention().not_supported_reasons(model))
    with pytest.raises(NotSupportedError, match=refusal):
        SharedPrefixAttention().completion_logprobs(model, batch)


def test_probe_is_cached_and_leaves_the_model_as_it_was():  # type: ignore[no-untyped-def]
    model = exact_model("qwen2", vocab_size=48)
    model.train()
    model.model.layers[0].eval()
    flags = [m.training for m in model.modules()]
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    assert SharedPrefixAttention().not_supported_reasons(model) == []
    assert SharedPrefixAttention("eager").not_supported_reasons(model) == []
    assert len(calls) == 1  # one probe forward per model
    assert [m.training for m in model.modules()] == flags
    assert model.config._attn_implementation == "sdpa"


def test_receipts_survive_copies_of_the_layout():  # type: ignore[no-untyped-def]
    """FSDP2 casts forward inputs with ``_apply_to_tensors``, which rebuilds dataclasses and lists:
    the copy the kernel gets must still record into the backend's layout (verl's engine on CPU)."""
    layout = build_grouped_inputs(_batch(), LayoutSettings(kernel="eager")).layout
    copies = [dataclasses.replace(layout)]
    apply = (
        getattr(torch.distributed.utils, "_apply_to_tensors", None)
        if torch.distributed.is_available()
        else None
    )
    if apply is not None:
        copies.append(apply(lambda t: t, {LAYOUT_KWARG: layout})[LAYOUT_KWARG])
    for copy in copies:
        copy.receipts.append("module")
    assert len(layout.receipts) == len(copies)


def _layout_call(**kwargs):  # type: ignore[no-untyped-def]
    """Call the kernel directly on a llama attention module with random q/k/v in the grid layout."""
    model = exact_model("llama", vocab_size=48, num_kv_heads=2)
    module = model.model.layers[0].self_attn
    grouped = build_grouped_inputs(_batch(), LayoutSettings(kernel="eager"))
    b, length = grouped.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 4, length, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, 2, length, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = kwargs.pop("attention_mask", torch.ones(b, 1, 1, 1, dtype=torch.bool))
    return shared_prefix_attention(
        module, q, k, v, mask, scaling=0.3, **{LAYOUT_KWARG: grouped.layout}, **kwargs
    ), grouped.layout


def test_unknown_attention_kwargs_are_refused():  # type: ignore[no-untyped-def]
    (out, _), layout = _layout_call(position_ids=torch.zeros(1), use_cache=False, output_attentions=False)
    assert out.shape[-1] == 8 and len(layout.receipts) == 1
    with pytest.raises(
        NotSupportedError, match=r"LlamaAttention \(llama model, layer 0\) passes keyword argument alibi"
    ):
        _layout_call(alibi=torch.zeros(1))
    with pytest.raises(NotSupportedError, match="output_attentions"):
        _layout_call(output_attentions=True)
    with pytest.raises(NotSupportedError, match="built its own mask"):
        _layout_call(attention_mask=torch.zeros(3, 1, 9, 9))
    module = exact_model("llama", vocab_size=48).model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    with pytest.raises(NotSupportedError, match="fallback.*cu_seq_lens_q"):  # no layout: SDPA, same rule
        shared_prefix_attention(module, q, q, q, None, scaling=0.3, cu_seq_lens_q=torch.zeros(2))


def test_attention_sinks():  # type: ignore[no-untyped-def]
    """gpt-oss passes its per-head sink logits as ``s_aux``: exact in the eager kernel (the family
    tests compare log-probs and gradients, incl. the sinks'), refused by the kernels without them
    and by the SDPA fallback."""
    model = exact_model("gpt_oss", vocab_size=48, num_kv_heads=2, head_dim=8)
    batch = _batch()
    backend = SharedPrefixAttention()
    with torch.no_grad():
        out = backend.completion_logprobs(model, batch).logprobs
        ref = RepeatedPrefixAttention().completion_logprobs(model, batch).logprobs
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        assert "chose kernel 'eager'" in backend.last_choice and "attention sinks" in backend.last_choice
        for kernel in ("sdpa", "flex"):
            with pytest.raises(NotSupportedError, match="attention sinks"):
                SharedPrefixAttention(kernel).completion_logprobs(model, batch)
        register_attention()
        model.set_attn_implementation(KERNEL_NAME)
        with pytest.raises(NotSupportedError, match=r"fallback.*attention sinks"):
            model(input_ids=batch.completion_ids)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_sliding_window_layers_beyond_the_window_are_refused(family):  # type: ignore[no-untyped-def]
    """Local (sliding-window) layers: exact while every sequence fits the window (the family tests),
    refused as soon as one does not."""
    batch = _batch(max_prompt=6, max_completion=5)
    longest = int((batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)).max())
    extra = {"head_dim": 8} if family == "gpt_oss" else {}
    model = exact_model(family, vocab_size=48, num_kv_heads=2, sliding_window=longest - 1, **extra)
    assert any("sliding window" in r for r in SharedPrefixAttention().not_supported_reasons(model, batch))
    with pytest.raises(NotSupportedError, match="sliding window"):
        SharedPrefixAttention().completion_logprobs(model, batch)


def test_autocast_casts_q_k_v_to_the_autocast_dtype():  # type: ignore[no-untyped-def]
    """Under CPU autocast (TRL's bf16=True on a float32 model) RoPE leaves q/k in float32 and v in
    bfloat16; the kernel casts all three to the autocast dtype, as transformers' SDPA does."""
    model = exact_model("llama", vocab_size=48, num_kv_heads=2)
    module = model.model.layers[0].self_attn
    grouped = build_grouped_inputs(_batch(), LayoutSettings(kernel="sdpa"))
    b, length = grouped.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 4, length, 8, generator=gen)
    k, v = (torch.randn(b, 2, length, 8, generator=gen) for _ in range(2))
    mask = torch.ones(b, 1, 1, 1, dtype=torch.bool)
    lay = {LAYOUT_KWARG: grouped.layout}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = shared_prefix_attention(module, q, k, v.bfloat16(), mask, scaling=0.3, **lay)
    expected, _ = shared_prefix_attention(
        module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scaling=0.3, **lay
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # a float32 model under bf16 autocast: the backend agrees with the reference to bf16 precision
    model32 = tiny_causal_lm("llama", vocab_size=48, num_kv_heads=2)
    batch = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out32 = SharedPrefixAttention().completion_logprobs(model32, batch).logprobs
        ref32 = RepeatedPrefixAttention().completion_logprobs(model32, batch).logprobs
    torch.testing.assert_close(out32, ref32, atol=5e-2, rtol=0)
