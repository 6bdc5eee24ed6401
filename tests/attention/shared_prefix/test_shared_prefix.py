"""Shared-prefix backend == repeated-prefix reference: log-probs and every parameter gradient of a
GRPO loss, float64 on CPU, live reference, 1e-10 absolute (1e-9 where transformers 4.x routes MoE
experts in float32), for every family of :data:`FAMILIES` the installed transformers supports."""

from __future__ import annotations

import pytest
import torch
from _attention_helpers import exact_model, logps_and_grads, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.attention import IMPLEMENTATIONS, get_attention_class
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.compat import transformers_version
from grpo_parts.errors import NotSupportedError
from grpo_parts.tiny import family_missing

ATOL = 1e-10
#: transformers 4.x MoE blocks take the router softmax in float32 (``dtype=torch.float``), which for
#: a float64 model rounds the routing weights (relative 6e-8): the two paths then differ at up to
#: ~2e-8 in the gradients. (atol, rtol) for those; a wrong layout is off by > 1e-3.
TOL_FP32_ROUTER = (1e-8, 1e-6)
FAMILIES = [
    *("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"),
    *("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"),  # MoE (gpt_oss: attention sinks)
    *("gpt2", "opt", "biogpt"),  # LayerNorm, learned absolute positions
    *("phi", "gpt_neox", "persimmon"),  # partial rotary
    *("olmo2", "exaone4", "smollm3", "starcoder2", "granite", "glm4"),
]
#: families refused below a transformers release: (release, what the refusal names)
REFUSED_BEFORE = {
    "qwen2_moe": ((5, 0), "ran without the shared-prefix layout"),  # 4.x layer drops attention kwargs
    "olmoe": ((5, 0), "ran without the shared-prefix layout"),
    "gpt2": ((5, 0), "ran without the shared-prefix layout"),
    "opt": ((5, 0), "no logits_to_keep argument"),
    "biogpt": ((5, 0), "no logits_to_keep argument"),
}
#: families with attention sinks: only the eager kernel implements them
SINKS = {"gpt_oss"}


def refused_here(family: str) -> str | None:
    """What the backend's refusal of ``family`` says under the installed transformers, or None."""
    before = REFUSED_BEFORE.get(family)
    return before[1] if before is not None and transformers_version() < before[0] else None


def tolerance(family: str) -> tuple[float, float]:
    """(atol, rtol) of the comparison for ``family`` under the installed transformers."""
    fp32_router = transformers_version() < (5, 0) and family in ("mixtral", "qwen3_moe")
    return TOL_FP32_ROUTER if fp32_router else (ATOL, 0.0)


def kernels_for(family: str) -> tuple[str, ...]:
    return ("eager",) if family in SINKS else ("sdpa", "eager")


RUNNABLE = [f for f in FAMILIES if family_missing(f) is None and refused_here(f) is None]


def assert_equivalent(model, batch, kernel, temperature=1.0, tol=(ATOL, 0.0), **options):  # type: ignore[no-untyped-def]
    if options.get("chunk_overhead_tokens", 0) < 0:  # a forced split is a grid plan
        options.setdefault("layout", "grid")
    ref, ref_g = logps_and_grads(RepeatedPrefixAttention(), model, batch, temperature)
    backend = SharedPrefixAttention(kernel, **options)
    out, out_g = logps_and_grads(backend, model, batch, temperature)
    atol, rtol = tol
    if options.get("layout", "auto") != "auto":  # the layout asked for ran
        assert backend.last_plan["layout"] == options["layout"]
    if options.get("chunk_overhead_tokens", 0) < 0:  # a split was asked for: it must have happened
        groups = int(torch.unique(batch.group_index).numel())
        assert backend.last_plan["chunks"] == min(options.get("max_chunks", 8), groups)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.entropies, ref.entropies, atol=atol, rtol=rtol)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, out_g, ref_g):
        torch.testing.assert_close(
            a, b, atol=atol, rtol=rtol, msg=lambda m, name=name: f"grad of {name}: {m}"
        )


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    family = draw(st.sampled_from(RUNNABLE))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    layers = draw(st.integers(1, 2))
    groups = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    return dict(
        family=family,
        heads=heads,
        kv=kv,
        head_dim=head_dim,
        layers=layers,
        groups=groups,
        max_prompt=draw(st.integers(1, 6)),
        max_completion=draw(st.integers(1, 5)),
        kernel=draw(st.sampled_from(kernels_for(family))),
        layout=draw(st.sampled_from(["grid", "padding_free", "auto"])),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        seed=draw(st.integers(0, 2**16)),
        # several grids (groups split by completion length); a negative overhead forces the split
        chunks=draw(st.sampled_from([{}, {"max_chunks": 2, "chunk_overhead_tokens": -1},
                                     {"max_chunks": 8, "chunk_overhead_tokens": -1}])),
    )  # fmt: skip


@settings(max_examples=30, derandomize=True, deadline=None)
@given(case=cases())
def test_equivalent_to_reference(case):  # type: ignore[no-untyped-def]
    model = exact_model(
        case["family"],
        vocab_size=48,
        hidden_size=case["heads"] * case["head_dim"],
        num_heads=case["heads"],
        num_kv_heads=case["kv"],
        head_dim=case["head_dim"],
        num_layers=case["layers"],
        seed=case["seed"],
    )
    gen = torch.Generator().manual_seed(case["seed"])
    batch = random_batch(
        gen, case["groups"], vocab=48, max_prompt=case["max_prompt"], max_completion=case["max_completion"]
    )
    assert_equivalent(
        model, batch, case["kernel"], case["temperature"], tol=tolerance(case["family"]),
        **({"layout": "grid", **case["chunks"]} if case["chunks"] else {"layout": case["layout"]}),
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family(family):  # type: ignore[no-untyped-def]
    """Deterministic coverage of each architecture with each kernel that implements it: GQA,
    shuffled rows, a singleton group, variable prompt and completion lengths. A family that this
    transformers release makes impossible is refused up front (and the test checks the refusal)."""
    if family_missing(family):
        pytest.skip(family_missing(family))
    model = exact_model(family, vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2)
    batch = random_batch(
        torch.Generator().manual_seed(3), [3, 1, 2], vocab=48, max_prompt=7, max_completion=5
    )
    refusal = refused_here(family)
    if refusal is not None:
        assert any(refusal in r for r in SharedPrefixAttention().not_supported_reasons(model, batch))
        with pytest.raises(NotSupportedError, match=refusal):
            SharedPrefixAttention("eager").completion_logprobs(model, batch)
        return
    assert SharedPrefixAttention().not_supported_reasons(model, batch) == []
    for kernel in kernels_for(family):
        for layout in ("grid", "padding_free"):
            assert_equivalent(model, batch, kernel, tol=tolerance(family), layout=layout)


def test_sdpa_chunking_options(monkeypatch):  # type: ignore[no-untyped-def]
    import grpo_parts.attention.shared_prefix.cascade as cascade

    flash_calls = []
    slots4 = cascade._slots4
    monkeypatch.setattr(cascade, "_slots4", lambda *a: flash_calls.append(1) or slots4(*a))
    model = exact_model("llama", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2)
    batch = random_batch(
        torch.Generator().manual_seed(3), [3, 1, 2], vocab=48, max_prompt=7, max_completion=5
    )
    assert_equivalent(model, batch, "sdpa", tile_elems=1, layout="grid")  # one slot per suffix-self tile
    assert_equivalent(
        model, batch, "sdpa", tile_elems=1, layout="grid"
    )  # (the default threshold: no flash here)
    assert not flash_calls
    assert_equivalent(model, batch, "sdpa", suffix_flash_min=1, layout="grid")  # suffix-self through flash
    assert flash_calls  # the option reached the kernel (it used to be dropped on the way)
    for kernel in ("sdpa", "eager"):  # one grid per group
        assert_equivalent(model, batch, kernel, max_chunks=8, chunk_overhead_tokens=-1, layout="grid")


def test_no_grad_forwards_and_flex():  # type: ignore[no-untyped-def]
    """Old-policy / reference forwards run without grad; FlexAttention runs there on CPU."""
    model = exact_model("qwen2", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2)
    batch = random_batch(torch.Generator().manual_seed(5), [2, 3], vocab=48, max_prompt=6, max_completion=4)
    with torch.no_grad():
        ref = RepeatedPrefixAttention().completion_logprobs(model, batch).logprobs
        for kernel in ("auto", "sdpa", "eager", "flex"):
            for layout in ("grid", "padding_free"):
                out = SharedPrefixAttention(kernel, layout=layout).completion_logprobs(model, batch).logprobs
                torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_registry_and_auto_choice():  # type: ignore[no-untyped-def]
    assert "shared_prefix" in IMPLEMENTATIONS
    backend = get_attention_class("shared_prefix")()
    model = exact_model("llama", vocab_size=48)
    batch = random_batch(torch.Generator().manual_seed(0), [2], vocab=48, max_prompt=4, max_completion=3)
    assert backend.not_supported_reasons(model, batch) == []
    backend.completion_logprobs(model, batch)
    assert "chose kernel 'sdpa'" in backend.last_choice
    assert model.config._attn_implementation == "sdpa"  # restored after the call


def test_fallback_without_layout_is_sdpa():  # type: ignore[no-untyped-def]
    """Registered as attn_implementation, the kernel behaves like SDPA for ordinary forwards."""
    from grpo_parts.attention.shared_prefix.run import KERNEL_NAME, register_attention

    register_attention()
    model = exact_model("qwen2", vocab_size=48)
    ids = torch.randint(1, 48, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation(KERNEL_NAME)
        out = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
