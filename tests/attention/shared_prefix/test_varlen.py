"""The padding-free layout's varlen cascade (``attention/shared_prefix/varlen.py``) == the repeated-prefix
reference and == the dense masked SDPA path it replaces (float64, CPU, live): log-probs, entropies
and every parameter gradient of a loss on both, across the families test_padding_free.py draws,
grouped-query heads, groups of one completion, completions of one token, very different lengths in
one group, several groups per row; the kernel-level op on random spans (MLA head sizes, the padding
column); the bucketing; and that the cascade ran (counted) while the masked path did not."""

from __future__ import annotations

import dataclasses

import torch
from _attention_helpers import VARIANTS, exact_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_padding_free import CLASSES, FAMILIES, long_tailed

from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.padding_free import PaddingFreeLayout, padding_free_attention
from grpo_parts.attention.shared_prefix.varlen import bucket_lengths, varlen_plan
from grpo_parts.core import grpo_loss

#: families whose sdpa kernel can run (gpt-oss' attention sinks are eager-only)
SDPA_FAMILIES = [f for f in FAMILIES + CLASSES if f != "gpt_oss"]


def outputs_and_grads(backend, model, batch, temperature):  # type: ignore[no-untyped-def]
    """Log-probs, entropies and the gradient of a GRPO loss plus an entropy bonus w.r.t. every parameter."""
    out = backend.completion_logprobs(model, batch, temperature=temperature, compute_entropy=True)
    n = batch.prompt_ids.shape[0]
    adv = torch.linspace(-1.0, 1.5, n, dtype=torch.float64)
    old = out.logprobs.detach() + 0.03
    loss = grpo_loss(out.logprobs, old, adv, batch.completion_mask).loss - 0.1 * out.entropies.sum()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [out.logprobs, out.entropies] + [
        torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)
    ]


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    family = draw(st.sampled_from(SDPA_FAMILIES))
    kv = draw(st.sampled_from([1, 2]))
    return dict(
        family=family,
        kv=kv,
        heads=kv * draw(st.sampled_from([1, 2, 3])),
        layers=draw(st.integers(1, 2)),
        groups=draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)),
        max_prompt=draw(st.integers(1, 6)),
        short=draw(st.integers(1, 3)),
        long=draw(st.integers(4, 12)),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        seed=draw(st.integers(0, 2**16)),
    )


def model_and_batch(case, **extra):  # type: ignore[no-untyped-def]
    """The case's float64 model (``extra``: config overrides), long-tailed batch and tolerances."""
    name = case["family"]
    context = VARIANTS[name][2] if name in VARIANTS else None
    kv = case["heads"] if name == "minicpm3_like" else case["kv"]  # (see test_padding_free.py)
    model = exact_model(name, vocab_size=48, hidden_size=8 * case["heads"], num_heads=case["heads"],
                        num_kv_heads=kv, head_dim=8, num_layers=case["layers"], seed=case["seed"],
                        **extra)  # fmt: skip
    gen = torch.Generator().manual_seed(case["seed"])
    long = case["long"] if context is None else min(case["long"], context - case["max_prompt"])
    batch = long_tailed(gen, case["groups"], case["max_prompt"], case["short"], max(long, case["short"]))
    tol = (1e-8, 1e-6) if name == "minicpm3_like" else (1e-10, 0.0)  # DeepSeek routes in float32
    return model, batch, tol


def check_against_reference_and_masked(  # type: ignore[no-untyped-def]
    model, batch, case, kernel: str, path: str, atol: float, rtol: float
):
    """The padding-free ``kernel`` against the reference and against its own ``varlen=False`` path:
    log-probs, entropies and every gradient; ``path`` ran in every layer, the masked path never."""
    ref = outputs_and_grads(RepeatedPrefixAttention(), model, batch, case["temperature"])
    new = SharedPrefixAttention(kernel, layout="padding_free")
    got = outputs_and_grads(new, model, batch, case["temperature"])
    masked = SharedPrefixAttention(kernel, layout="padding_free", varlen=False)
    old = outputs_and_grads(masked, model, batch, case["temperature"])
    assert new.last_plan["attention_calls"] == {path: case["layers"]}
    assert masked.last_plan["attention_calls"] == {f"masked_{kernel}": case["layers"]}
    names = ["logprobs", "entropies"] + [n for n, p in model.named_parameters() if p.requires_grad]
    for n, a, b, c in zip(names, got, ref, old):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n} vs reference: {m}")
        torch.testing.assert_close(a, c, atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n} vs masked: {m}")
    return masked


@settings(max_examples=25, derandomize=True, deadline=None)
@given(case=cases())
def test_equivalent_to_reference_and_to_the_masked_path(case):  # type: ignore[no-untyped-def]
    model, batch, (atol, rtol) = model_and_batch(case)
    masked = check_against_reference_and_masked(model, batch, case, "sdpa", "varlen_cascade", atol, rtol)
    assert masked.last_plan["masked_sdpa_why"] == "varlen=False (requested)"


def _layout(groups: list[tuple[int, list[int]]], pad: bool) -> PaddingFreeLayout:
    """A padding-free row of ``(prefix_len, completion_lens)`` groups (+ the padding column)."""
    sid: list[int] = []
    spans = []
    for p, lens in groups:
        a = len(sid)
        sid += [0] * p
        for n in lens:
            sid += [int(sid and max(sid)) + 1] * n
        spans.append((a, len(sid)))
    if pad:
        spans.append((len(sid), len(sid) + 1))
        sid.append(-1)
    return PaddingFreeLayout(len(sid), tuple(spans), torch.tensor(sid), len(sid), "sdpa")


@st.composite
def rows(draw):  # type: ignore[no-untyped-def]
    groups = draw(
        st.lists(
            st.tuples(st.integers(1, 9), st.lists(st.integers(1, 40), min_size=1, max_size=6)),
            min_size=1,
            max_size=3,
        )
    )
    kv = draw(st.sampled_from([1, 2]))
    return dict(
        groups=groups,
        pad=draw(st.booleans()),
        kv=kv,
        heads=kv * draw(st.sampled_from([1, 3])),
        d=draw(st.sampled_from([4, 8])),
        dv=draw(st.sampled_from([4, 6, 8])),  # != d: MLA
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, derandomize=True, deadline=None)
@given(case=rows())
def test_kernel_equals_the_masked_path_forward_and_backward(case):  # type: ignore[no-untyped-def]
    lay = _layout(case["groups"], case["pad"])
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (1, case["heads"], lay.row_len, case["d"])
    q = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn((1, case["kv"], lay.row_len, case["d"]), generator=gen, dtype=torch.float64)
    v = torch.randn((1, case["kv"], lay.row_len, case["dv"]), generator=gen, dtype=torch.float64)
    k.requires_grad_(True)
    v.requires_grad_(True)
    w = torch.randn((1, case["heads"], lay.row_len, case["dv"]), generator=gen, dtype=torch.float64)
    res = []
    for varlen in (True, False):
        lay_ = dataclasses.replace(lay, varlen=varlen, masks=type(lay.masks)())
        o = padding_free_attention(q, k, v, lay_, 0.37, None, None)
        res.append([o, *torch.autograd.grad((o * w).sum(), (q, k, v))])
        assert dict(lay_.masks.calls) == {"varlen_cascade" if varlen else "masked_sdpa": 1}
    for name, a, b in zip(("out", "dq", "dk", "dv"), *res):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=60))
@settings(max_examples=50, derandomize=True, deadline=None)
def test_buckets_cover_every_completion_once_with_bounded_padding(lengths):  # type: ignore[no-untyped-def]
    buckets = bucket_lengths(lengths, 0.25)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        assert min(lengths[i] for i in b) * 1.25 >= max(lengths[i] for i in b)


def test_plan_scores_scale_with_the_completions_not_the_span():  # type: ignore[no-untyped-def]
    """G=16, P=64, long-tailed completions: the cascade computes a fraction of the dense mask's scores."""
    lens = [40, 60, 80, 100, 110, 120, 130, 132, 132, 140, 160, 200, 260, 330, 450, 623]
    lay = _layout([(64, lens)], pad=False)
    plan = varlen_plan(lay.spans, lay.suffix_id)
    assert sorted(plan.pos.tolist()) == list(range(64, lay.row_len))  # every suffix token once
    assert plan.scores < 0.2 * lay.row_len**2
