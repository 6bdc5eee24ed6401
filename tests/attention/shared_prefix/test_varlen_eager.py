"""The padding-free layout's ``eager`` kernel on the varlen plan (``attention/shared_prefix/varlen_eager.py``) ==
the repeated-prefix reference and == the dense span mask it replaces (``varlen=False``), float64,
CPU, live: log-probs, entropies and every parameter gradient across the families test_varlen.py
draws plus attention sinks (gpt-oss) and attention logit soft-capping (Gemma-2, exact eager
reference); the kernel-level op with soft-capping and sinks on random rows (buckets mixing spans of
different prefix lengths, MLA head sizes, the padding column), gradients of the sinks included; its
score count; and that it ran (counted) while the dense path did not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _attention_helpers import use_exact_eager
from hypothesis import given, settings
from hypothesis import strategies as st
from test_padding_free import CLASSES, FAMILIES
from test_varlen import _layout, cases, check_against_reference_and_masked, model_and_batch, rows

from grpo_parts.attention.shared_prefix.padding_free import padding_free_attention
from grpo_parts.attention.shared_prefix.varlen import varlen_plan
from grpo_parts.attention.shared_prefix.varlen_eager import eager_scores

#: every family of the padding-free tests, plus Gemma-2 with attention logit soft-capping
EAGER_FAMILIES = FAMILIES + CLASSES + (["gemma2_softcap"] if "gemma2" in FAMILIES else [])


@st.composite
def eager_cases(draw):  # type: ignore[no-untyped-def]
    return {**draw(cases()), "family": draw(st.sampled_from(EAGER_FAMILIES))}


@settings(max_examples=25, derandomize=True, deadline=None)
@given(case=eager_cases())
def test_equivalent_to_reference_and_to_the_dense_mask(case):  # type: ignore[no-untyped-def]
    _check(case)


@pytest.mark.parametrize("family", [f for f in ("gemma2_softcap", "gpt_oss") if f in EAGER_FAMILIES])
def test_softcap_and_sinks_families(family):  # type: ignore[no-untyped-def]
    """Whatever hypothesis draws: the soft-capped and the sinks family, two groups per row, GQA."""
    case = dict(family=family, kv=2, heads=4, layers=2, groups=[4, 2, 3], max_prompt=6, short=2, long=9,
                temperature=0.7, seed=11)  # fmt: skip
    _check(case)


def _check(case):  # type: ignore[no-untyped-def]
    if case["family"] == "gemma2_softcap":  # the reference runs the float64-exact eager with the cap
        model, batch, (atol, rtol) = model_and_batch({**case, "family": "gemma2"}, attn_logit_softcapping=2.0)
        use_exact_eager(model)
    else:
        model, batch, (atol, rtol) = model_and_batch(case)
    check_against_reference_and_masked(model, batch, case, "eager", "varlen_eager", atol, rtol)


def _kernel_vs_dense(lay, heads, kv, d, dv, seed, softcap, sinks):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((1, heads, lay.row_len, d), generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn((1, kv, lay.row_len, d), generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn((1, kv, lay.row_len, dv), generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn((1, heads, lay.row_len, dv), generator=gen, dtype=torch.float64)
    sink = torch.randn(heads, generator=gen, dtype=torch.float64).requires_grad_() if sinks else None
    inputs = (q, k, v) if sink is None else (q, k, v, sink)
    res = []
    for varlen in (True, False):
        lay_ = dataclasses.replace(lay, kernel="eager", varlen=varlen, masks=type(lay.masks)())
        o = padding_free_attention(q, k, v, lay_, 0.37, softcap, sink)
        res.append([o, *torch.autograd.grad((o * w).sum(), inputs)])
        assert dict(lay_.masks.calls) == {"varlen_eager" if varlen else "masked_eager": 1}
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), *res):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@settings(max_examples=40, derandomize=True, deadline=None)
@given(case=rows(), softcap=st.sampled_from([None, 0.8, 5.0]), sinks=st.booleans())
def test_kernel_equals_the_dense_mask_softcap_sinks(case, softcap, sinks):  # type: ignore[no-untyped-def]
    lay = _layout(case["groups"], case["pad"])
    _kernel_vs_dense(lay, case["heads"], case["kv"], case["d"], case["dv"], case["seed"], softcap, sinks)


def test_a_bucket_of_two_spans_with_different_prefixes():  # type: ignore[no-untyped-def]
    """Completions of equal length in spans of prefix 2 and 9 share a bucket: each reads its own
    prefix (the shorter one masked past its end)."""
    lay = _layout([(2, [5, 1]), (9, [5, 4]), (1, [6])], pad=True)
    plan = varlen_plan(lay.spans, lay.suffix_id)
    assert any(idx.shape[0] >= 3 for idx, _ in plan.buckets)  # 5, 5, 4 (and 6) together
    _kernel_vs_dense(lay, 4, 2, 8, 6, 0, 1.5, True)


def test_scores_scale_with_the_completions_not_the_span():  # type: ignore[no-untyped-def]
    """G=16, P=64, long-tailed completions: whole squares per part, still a fraction of the dense mask."""
    lens = [40, 60, 80, 100, 110, 120, 130, 132, 132, 140, 160, 200, 260, 330, 450, 623]
    lay = _layout([(64, lens)], pad=False)
    plan = varlen_plan(lay.spans, lay.suffix_id)
    exact = 64 * 64 + sum(s * (64 + s) for s in lens)
    assert exact <= eager_scores(plan) <= 1.25 * exact  # bucket padding below the slack
    assert eager_scores(plan) < 0.3 * lay.row_len**2
