"""Models whose decoder layers differ -- head size, KV heads, MLP width, attention type, KV sharing:
Gemma 3n (per-layer ``intermediate_size`` lists), Gemma 4 (per-layer-type head sizes; from
transformers 5.16 a ``per_layer_config`` whose global reads raise), their MoE variants -- are exact
(float64 against the reference, forward and backward) or refused with reasons. No stage of the
shared-prefix call lets a raw exception escape, and for EVERY architecture the attention tests build
``not_supported_reasons`` agrees with what the call then does: no reasons -> it computes the
reference's numbers; reasons -> it raises :class:`NotSupportedError` with them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _attention_helpers import exact_model, variant_family
from test_shared_prefix import FAMILIES, TOL_FP32_ROUTER, assert_equivalent
from test_shared_prefix import tolerance as family_tolerance
from test_shared_prefix_architectures import MLA, POSITIONS, model_kwargs, variant_batch
from test_shared_prefix_architectures import tolerance as class_tolerance

from grpo_parts.attention.shared_prefix import guard as guard_module
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.layout_choice import layer_sizes, score_weight
from grpo_parts.compat import transformers_version
from grpo_parts.errors import NotSupportedError
from grpo_parts.tiny import family_missing

HETEROGENEOUS = ("gemma3n", "gemma4", "gemma3n_layers", "gemma4_layers", "gemma4_k_eq_v", "gemma4_moe")
#: built by test_guard.py: refused architectures (family, config overrides)
REFUSED = {
    "stablelm": ("stablelm", {}),
    "falcon": ("falcon", {}),
    "falcon_alibi": ("falcon", {"alibi": True}),
    "bloom": ("bloom", {}),
    "mpt": ("mpt", {}),
    "lfm2": ("lfm2", {}),
    "gemma2_window": ("gemma2", {"sliding_window": 3}),  # a local layer shorter than the batch's rows
}


def hetero_tolerance(name: str) -> tuple[float, float]:
    """From transformers 5.16 Gemma 4 takes its MoE router softmax in float32 (``dtype=torch.float32``),
    which rounds the float64 routing weights, as in the MoE families of test_shared_prefix.py."""
    return TOL_FP32_ROUTER if name == "gemma4_moe" else (1e-10, 0.0)


def _builders() -> dict[str, tuple[str, Callable[[], Any], tuple[float, float]]]:
    """name -> (family, build the model, tolerance) for every architecture the attention tests build."""
    out: dict[str, tuple[str, Callable[[], Any], tuple[float, float]]] = {}
    for f in FAMILIES:
        shape = dict(vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2)
        out[f] = (f, lambda f=f, shape=shape: exact_model(f, **shape), family_tolerance(f))
    for n in (*MLA, *POSITIONS):
        kv = 4 if n in MLA else 2
        build = lambda n=n, kv=kv: exact_model(  # noqa: E731
            n, vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=kv, **model_kwargs(n)
        )
        out[n] = (variant_family(n), build, class_tolerance(n))
    for n in HETEROGENEOUS:
        build = lambda n=n: exact_model(n, vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2)  # noqa: E731
        out[n] = (variant_family(n), build, hetero_tolerance(n))
    for n, (f, over) in REFUSED.items():
        build = lambda f=f, over=over: exact_model(f, vocab_size=48, num_kv_heads=2, **over)  # noqa: E731
        out[n] = (f, build, (1e-10, 0.0))
    return out


ARCHITECTURES = _builders()


def _batch(name: str) -> Any:
    return variant_batch(name, max_completion=5)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_capability_check_agrees_with_the_call(name):  # type: ignore[no-untyped-def]
    """Reasons empty: the default backend's call equals the reference (log-probs, entropies, every
    gradient). Reasons given: the call raises NotSupportedError carrying them."""
    family, build, tol = ARCHITECTURES[name]
    if family_missing(family):
        pytest.skip(family_missing(family))
    model, batch = build(), _batch(name)
    reasons = SharedPrefixAttention().not_supported_reasons(model, batch)
    if not reasons:
        assert_equivalent(model, batch, "auto", tol=tol)
        return
    with pytest.raises(NotSupportedError) as err:
        SharedPrefixAttention().completion_logprobs(model, batch)
    for r in reasons:  # (a probe's reason names the same cause; its call counts may differ)
        assert r[:60] in str(err.value), (r, str(err.value))


@pytest.mark.parametrize("name", ["gemma3n_layers", "gemma4_layers", "gemma4_k_eq_v", "gemma4_moe"])
def test_heterogeneous_layers_are_exact(name):  # type: ignore[no-untyped-def]
    """Both kernels, both layouts, a forced split: the reference's numbers."""
    if family_missing(variant_family(name)):
        pytest.skip(family_missing(variant_family(name)))
    model, batch = ARCHITECTURES[name][1](), _batch(name)
    reasons = SharedPrefixAttention().not_supported_reasons(model, batch)
    if name == "gemma3n_layers" and transformers_version() < (5, 0):
        # 4.x shares keys and values through the cache only: without one the layers compute their own
        assert any("through the KV cache" in r for r in reasons)
        return
    assert reasons == []
    for kernel, options in [
        ("sdpa", {"layout": "grid"}),
        ("eager", {"layout": "padding_free"}),
        ("sdpa", {"max_chunks": 2, "chunk_overhead_tokens": -1}),
    ]:
        assert_equivalent(model, batch, kernel, tol=hetero_tolerance(name), **options)


def test_per_layer_sizes_feed_the_layout_cost():  # type: ignore[no-untyped-def]
    """Gemma 3n's ``intermediate_size`` list (the TypeError of issue 38) and Gemma 4's larger
    full-attention heads (``global_head_dim``, or ``per_layer_config`` from transformers 5.16) are
    read per layer."""
    for fam in ("gemma3n", "gemma4"):
        if family_missing(fam):
            pytest.skip(family_missing(fam))
    g3n = exact_model("gemma3n_layers", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2)
    assert [s[3] for s in layer_sizes(g3n.config)] == [64, 48, 80, 32]
    assert score_weight(g3n.config) > 0
    g4 = exact_model("gemma4_layers", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2)
    assert [(s[1], s[2]) for s in layer_sizes(g4.config)] == [(8, 2), (16, 2)] * 2
    assert score_weight(g4.config) > 0
    g4 = exact_model("gemma4_k_eq_v", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2)
    assert [(s[1], s[2]) for s in layer_sizes(g4.config)] == [(8, 2), (16, 1), (16, 1)]
    # the sizes the modules were built with
    assert [
        (a.head_dim, a.config.num_attention_heads // a.num_key_value_groups) for a in attention_modules(g4)
    ] == [
        (8, 2),
        (16, 1),
        (16, 1),
    ]


def attention_modules(model: torch.nn.Module) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


class AmbiguousRead(RuntimeError):
    """What transformers 5.15+ raises on a global read of a per-layer attribute (a RuntimeError:
    ``getattr(config, key, default)`` does not catch it)."""


def heterogeneous(model: torch.nn.Module, per_layer: dict[str, list[Any]]) -> torch.nn.Module:
    """``model`` with a config that behaves as transformers 5.16's heterogeneous ones: a global read
    of a key of ``per_layer`` raises :class:`AmbiguousRead`; ``per_layer_config[i]`` holds layer
    ``i``'s values. (The installed release may predate them; the model is local to the test.)"""
    cfg = model.config
    layers = [copy.copy(cfg) for _ in range(cfg.num_hidden_layers)]
    for key, values in per_layer.items():
        for layer, v in zip(layers, values):
            setattr(layer, key, v)

    class Heterogeneous(type(cfg)):  # type: ignore[misc]
        per_layer_config = property(lambda self: layers)
        per_layer_attributes = property(lambda self: set(per_layer))

        def __getattribute__(self, key: str) -> Any:
            if key in per_layer:
                raise AmbiguousRead(f"{key!r} is a per-layer attribute")
            return super().__getattribute__(key)

    cfg.__class__ = Heterogeneous
    return model


def test_a_per_layer_config_is_read_per_layer():  # type: ignore[no-untyped-def]
    """Global reads that raise are never made: the capability check, the layout cost and the call
    read each layer's value (same numbers as the homogeneous model); a per-layer attention dropout
    is found on the layer that has it."""
    model = exact_model("llama", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2)
    weight = score_weight(model.config)
    keys = ("head_dim", "intermediate_size", "num_key_value_heads", "max_position_embeddings")
    heterogeneous(
        model, {k: [getattr(model.config, k)] * 2 for k in keys} | {"attention_dropout": [0.0, 0.1]}
    )
    with pytest.raises(AmbiguousRead):
        model.config.head_dim  # noqa: B018
    assert score_weight(model.config) == pytest.approx(weight)
    batch = _batch("llama")
    assert SharedPrefixAttention().not_supported_reasons(model, batch) == []
    assert_equivalent(model, batch, "sdpa")
    model.train()
    assert any("attention dropout" in r for r in SharedPrefixAttention().not_supported_reasons(model, batch))


@pytest.mark.parametrize(
    ("module", "target", "stage"),
    [
        ("plan", "auto_costs", "planning the call failed: TypeError"),
        ("chunking", "chunk_plan", "planning the call failed: TypeError"),
        ("backend", "make_plan", "planning the call failed: TypeError"),
        ("layout", "build_grouped_inputs", "building the layout failed: TypeError"),
        ("run", "ungroup_logits", "un-grouping the logits failed: TypeError"),
    ],
)
def test_no_stage_lets_a_raw_exception_escape(monkeypatch, module, target, stage):  # type: ignore[no-untyped-def]
    """An unexpected exception in any stage is a NotSupportedError naming the model and the stage."""
    import importlib

    model, batch = exact_model("qwen2", vocab_size=48), _batch("qwen2")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("unsupported operand type(s) for +: 'int' and 'list'")

    monkeypatch.setattr(
        importlib.import_module(f"grpo_parts.attention.shared_prefix.{module}"), target, broken
    )
    with pytest.raises(NotSupportedError, match=rf"Qwen2ForCausalLM \(qwen2\): {stage}"):
        SharedPrefixAttention(layout="grid").completion_logprobs(model, batch)


def test_a_failing_capability_check_is_a_reason(monkeypatch):  # type: ignore[no-untyped-def]
    model, batch = exact_model("qwen2", vocab_size=48), _batch("qwen2")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("layer_types")

    monkeypatch.setattr(guard_module, "architecture_reasons", broken)
    reasons = SharedPrefixAttention().not_supported_reasons(model, batch)
    assert reasons == [
        "model: Qwen2ForCausalLM (qwen2): the capability check failed: KeyError: 'layer_types'"
    ]
    with pytest.raises(NotSupportedError, match="the capability check failed: KeyError"):
        SharedPrefixAttention().completion_logprobs(model, batch)
