"""Padding-free shared-prefix layout == repeated-prefix reference (float64, CPU, live reference):
log-probs, entropies and every parameter gradient of a GRPO loss, on groups whose completions have
very different lengths; the model runs exactly each prompt once plus every completion token; the
automatic choice between grid and padding-free; positions; flex forward on CPU."""

from __future__ import annotations

import pytest
import torch
from _attention_helpers import VARIANTS, exact_model, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shared_prefix import assert_equivalent, refused_here
from test_shared_prefix_architectures import refusal

from grpo_parts.attention import LogprobBatch
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.facts import GroupFacts
from grpo_parts.attention.shared_prefix.layout_choice import choose_layout
from grpo_parts.attention.shared_prefix.padding_free import build_padding_free_inputs
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.tiny import family_missing

#: the families the installed transformers can run under the layout at all (GPT-2 before 5.0: refused,
#: tested in test_shared_prefix.py)
FAMILIES = [
    f
    for f in ("llama", "qwen2", "gemma2", "gpt2", "phi", "gpt_oss")
    if family_missing(f) is None and refused_here(f) is None
]
#: MLA (value head != query/key head) and position-dependent classes (see _attention_helpers.VARIANTS)
CLASSES = [
    v
    for v in ("minicpm3_like", "llama_dynamic", "gpt2_context")
    if family_missing(VARIANTS[v][0]) is None and refusal(v) is None
]


def long_tailed(
    gen: torch.Generator, groups: list[int], max_prompt: int, short: int, long: int
) -> LogprobBatch:
    """Groups whose completions are mostly ``<= short`` tokens with one row of ``long``."""
    batch = random_batch(gen, groups, vocab=48, max_prompt=max_prompt, max_completion=long)
    cm = batch.completion_mask.clone()
    first = torch.zeros_like(batch.group_index, dtype=torch.bool)
    for g in torch.unique(batch.group_index):
        first[int((batch.group_index == g).nonzero()[0])] = True
    cm[~first, short:] = 0  # every row but one per group is short
    cm[first] = 1  # one row per group runs the full length
    return LogprobBatch(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, cm, batch.group_index)


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    family = draw(st.sampled_from(FAMILIES + CLASSES))
    kv = draw(st.sampled_from([1, 2]))
    return dict(
        family=family,
        kv=kv,
        heads=kv * draw(st.sampled_from([1, 2])),
        layers=draw(st.integers(1, 2)),
        groups=draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)),
        max_prompt=draw(st.integers(1, 6)),
        short=draw(st.integers(1, 2)),
        long=draw(st.integers(3, 7)),
        kernel="eager" if family == "gpt_oss" else draw(st.sampled_from(["sdpa", "eager"])),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=25, derandomize=True, deadline=None)
@given(case=cases())
def test_equivalent_to_reference(case):  # type: ignore[no-untyped-def]
    name = case["family"]
    context = VARIANTS[name][2] if name in VARIANTS else None
    # MLA has no grouped KV heads (DeepSeek-V2's own sdpa path fails with them under transformers 4.x)
    kv = case["heads"] if name == "minicpm3_like" else case["kv"]
    model = exact_model(name, vocab_size=48, hidden_size=8 * case["heads"], num_heads=case["heads"],
                        num_kv_heads=kv, head_dim=8, num_layers=case["layers"], seed=case["seed"])  # fmt: skip
    gen = torch.Generator().manual_seed(case["seed"])
    long = case["long"] if context is None else min(case["long"], context - case["max_prompt"])
    batch = long_tailed(gen, case["groups"], case["max_prompt"], case["short"], max(long, case["short"]))
    tol = (1e-8, 1e-6) if name == "minicpm3_like" else (1e-10, 0.0)  # DeepSeek routes in float32
    assert_equivalent(model, batch, case["kernel"], case["temperature"], tol=tol, layout="padding_free")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_and_the_auto_choice(family):  # type: ignore[no-untyped-def]
    """auto picks padding-free on long-tailed groups (counted) and the result equals the reference."""
    model = exact_model(family, vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2)
    batch = long_tailed(torch.Generator().manual_seed(3), [4, 1, 3], max_prompt=6, short=2, long=7)
    kernel = "eager" if family == "gpt_oss" else "sdpa"
    assert_equivalent(model, batch, kernel)
    backend = SharedPrefixAttention(kernel)
    backend.completion_logprobs(model, batch)
    assert backend.last_plan["layout"] == "padding_free" and backend.layout_counts == {"padding_free": 1}
    assert backend.last_plan["padding_free_tokens"] < backend.last_plan["grid_slots"]


def test_model_tokens_and_logit_rows_are_exact():  # type: ignore[no-untyped-def]
    batch = long_tailed(torch.Generator().manual_seed(1), [3, 2, 4], max_prompt=6, short=2, long=9)
    grouped = build_padding_free_inputs(batch)
    plen, clen = batch.prompt_mask.sum(-1), batch.completion_mask.sum(-1)
    prompts = {int(g): int(plen[batch.group_index == g][0]) for g in torch.unique(batch.group_index)}
    assert grouped.input_ids.shape == (1, sum(prompts.values()) + int(clen.sum()))
    assert grouped.input_ids.shape[1] == GroupFacts.of(batch).padding_free_tokens
    # logit rows: each group's last prompt token (shared by its rows' first tokens), then one per
    # completion token after a row's first
    assert grouped.keep.numel() == len(prompts) + int(clen.sum()) - clen.numel()
    # positions: real tokens keep the reference's; a forced larger max_position adds one column
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    ref = set((mask.cumsum(-1) - 1)[mask.bool()].tolist())
    assert set(grouped.position_ids.unique().tolist()) == ref
    top = max(ref) + 3
    more = build_padding_free_inputs(batch, max_position=top)
    assert more.input_ids.shape[1] == grouped.input_ids.shape[1] + 1 and int(more.position_ids.max()) == top


def test_uniform_groups_keep_the_grid_and_split_forwards_carry_the_largest_position():  # type: ignore[no-untyped-def]
    model = exact_model("llama", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2)
    batch = random_batch(torch.Generator().manual_seed(2), [3, 3], vocab=48, max_prompt=4, max_completion=3)
    full = LogprobBatch(batch.prompt_ids, torch.ones_like(batch.prompt_mask), batch.completion_ids,
                        torch.ones_like(batch.completion_mask), batch.group_index)  # fmt: skip
    backend = SharedPrefixAttention()
    backend.completion_logprobs(model, full)
    assert backend.last_plan["layout"] == "grid"  # no padding to save: a tie keeps the grid
    assert choose_layout("auto", 10, 10)[0] == "grid" and choose_layout("auto", 11, 10)[0] == "padding_free"
    assert choose_layout("grid", 11, 10)[0] == "grid"
    with pytest.raises(GRPOPartsError, match="layout: expected 'auto' or one of"):
        SharedPrefixAttention(layout="packed")


def test_flex_forward_on_cpu_and_no_silent_fallback():  # type: ignore[no-untyped-def]
    """FlexAttention's packed block mask: exact forward on CPU (torch has no CPU flex backward: with
    grad it is refused, never replaced)."""
    model = exact_model("qwen2", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2)
    batch = long_tailed(torch.Generator().manual_seed(5), [3, 2], max_prompt=6, short=1, long=6)
    with torch.no_grad():
        ref = RepeatedPrefixAttention().completion_logprobs(model, batch, compute_entropy=True)
        backend = SharedPrefixAttention("flex", layout="padding_free")
        out = backend.completion_logprobs(model, batch, compute_entropy=True)
    assert backend.last_plan["layout"] == "padding_free"
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-10, rtol=0)
    torch.testing.assert_close(out.entropies, ref.entropies, atol=1e-10, rtol=0)
    with pytest.raises(NotSupportedError, match="no backward on CPU"):
        SharedPrefixAttention("flex", layout="padding_free").completion_logprobs(model, batch)


@pytest.mark.gpu
def test_flex_forward_and_backward_on_cuda():  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = exact_model("qwen2", vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2).cuda()
    batch = long_tailed(torch.Generator().manual_seed(5), [3, 2], max_prompt=6, short=1, long=6)
    batch = LogprobBatch(*(x.cuda() for x in (batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                               batch.completion_mask, batch.group_index)))  # fmt: skip
    assert_equivalent(model, batch, "flex", tol=(1e-8, 1e-6), layout="padding_free")
