"""verl adapter: shared-prefix log-probs on a packed (remove-padding) micro-batch equal verl's plain
packed forward (every sequence attends only to itself, as flash-attn varlen does) in float64,
forward and backward."""

from __future__ import annotations

import types

import pytest
import torch
from grpo_parts_adapters.verl import attention
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.attention import IMPLEMENTATIONS
from grpo_parts.tiny import tiny_causal_lm

TOL = 1e-10
BACKENDS = ["reference", "shared_prefix"]


@st.composite
def packed_batches(draw):
    """Groups of completions sharing a prompt, rows shuffled (verl balances/reorders rows), packed."""
    n_groups = draw(st.integers(1, 3))
    rows = []
    for g in range(n_groups):
        prompt = draw(st.lists(st.integers(1, 63), min_size=1, max_size=6))
        for _ in range(draw(st.integers(1, 4))):
            resp = draw(st.lists(st.integers(1, 63), min_size=1, max_size=5))
            rows.append((f"uid-{g}", prompt, resp))
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    ids = torch.tensor([t for _, p, r in rows for t in p + r])
    lens = torch.tensor([len(p) + len(r) for _, p, r in rows])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    resp_lens = torch.tensor([len(r) for _, _, r in rows])
    uids = [u for u, _, _ in rows]
    temperature = draw(st.sampled_from([1.0, 0.7]))
    return ids, cu, resp_lens, uids, temperature


def _float64_rms_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def model():
    """float64 end to end. transformers' RMSNorm computes in float32 (a *downcast* for a float64
    model), so a shared prefix that sums its gradient over G suffixes before the norm's backward
    differs from the per-row reference at ~1e-7 (rounding order); tests/attention/helpers.py found
    the same. Replace each norm instance's forward by the same formula without the cast."""
    m = tiny_causal_lm("qwen2", dtype=torch.float64, attn_implementation="sdpa", num_kv_heads=2, seed=1)
    for mod in m.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(_float64_rms_norm, mod)
    with torch.no_grad():  # larger weights: attention far from uniform, so a wrong mask shows
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return m


def plain_packed_logprobs(model, ids, cu, temperature):
    """verl's packed forward: one row of nnz tokens, per-sequence position ids, block-diagonal
    causal attention; log-probs of the rolled labels (verl's ``logprobs_from_logits`` semantics)."""
    nnz = ids.numel()
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())
    pos = torch.arange(nnz) - cu[:-1][seg]
    allowed = (seg[:, None] == seg[None, :]) & (torch.arange(nnz)[None, :] <= torch.arange(nnz)[:, None])
    mask = torch.zeros(1, 1, nnz, nnz, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask).logits[0]
    rolled = torch.roll(ids, shifts=-1)
    return torch.log_softmax(logits / temperature, -1).gather(-1, rolled[:, None]).squeeze(-1)


def _response_positions(cu, resp_lens):
    """Packed positions holding ``log p(response token t)`` in verl's rolled layout: ``cu[b] + P_b - 1 + t``."""
    starts = cu[:-1] + (cu.diff() - resp_lens) - 1
    return torch.cat([s + torch.arange(int(n)) for s, n in zip(starts.tolist(), resp_lens.tolist())])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12)
@given(batch=packed_batches())
def test_packed_logprobs_and_grads_equal_plain_packed_forward(model, backend, batch):
    if backend not in IMPLEMENTATIONS:
        pytest.skip(f"attention backend {backend!r} has not landed in grpo_parts.attention.IMPLEMENTATIONS")
    ids, cu, resp_lens, uids, temperature = batch
    where = _response_positions(cu, resp_lens)
    weights = torch.linspace(-1.0, 2.0, where.numel(), dtype=torch.float64)
    params = [p for p in model.parameters()]

    model.zero_grad()
    ref = plain_packed_logprobs(model, ids, cu, temperature)
    (ref[where] * weights).sum().backward()
    ref_grads = [p.grad.clone() for p in params]

    model.zero_grad()
    out = attention.packed_logprobs(model, ids, cu, resp_lens, uids, temperature, backend=backend)
    assert out.log_probs.shape == (ids.numel(),)
    (out.log_probs[where] * weights).sum().backward()

    torch.testing.assert_close(out.log_probs[where], ref[where].detach(), rtol=0, atol=TOL)
    others = torch.ones(ids.numel(), dtype=torch.bool)
    others[where] = False
    assert torch.all(out.log_probs[others] == 0)  # verl masks these with response_mask
    for p, g in zip(params, ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=TOL)


def test_grouping_without_uid_uses_identical_prompts_and_checks_uids():
    ids = torch.tensor([5, 6, 7, 1, 5, 6, 7, 2, 3, 9, 4])
    cu = torch.tensor([0, 4, 9, 11])
    resp = torch.tensor([1, 2, 1])
    plen = cu.diff() - resp
    assert attention.group_index(ids, cu, plen, None).tolist() == [0, 0, 1]
    assert attention.group_index(ids, cu, plen, ["x", "x", "y"]).tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="share uid 'a' but their prompts differ"):
        attention.group_index(ids, cu, plen, ["a", "a", "a"])
    with pytest.raises(ValueError, match="response_lens"):
        attention.packed_logprobs(torch.nn.Linear(1, 1), ids, cu, torch.tensor([4, 1, 1]))
    with pytest.raises(ValueError, match="temperature"):
        attention.packed_logprobs(torch.nn.Linear(1, 1), ids, cu, resp, temperature=torch.tensor([1.0, 0.5]))


def test_empty_responses_get_zeros_and_the_rest_is_unchanged(model):
    """verl can hand over a sequence without response tokens; it has nothing to score."""
    ids = torch.tensor([5, 6, 7, 1, 5, 6, 7, 11, 12, 9, 4])
    cu = torch.tensor([0, 4, 7, 11])
    full = attention.packed_logprobs(model, ids, cu, torch.tensor([1, 0, 2]), ["a", "a", "b"])
    where = _response_positions(cu, torch.tensor([1, 0, 2]))
    ref = plain_packed_logprobs(model, ids, cu, 1.0).detach()
    torch.testing.assert_close(full.log_probs[where], ref[where], rtol=0, atol=TOL)
    others = torch.ones(ids.numel(), dtype=torch.bool)
    others[where] = False
    assert torch.all(full.log_probs[others] == 0)


def _uneven_micro_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """Three uid groups of different prompt and completion lengths, rows interleaved."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for i, (plen, rlens) in enumerate([(3, [1, 2, 1]), (6, [9, 8]), (2, [2, 1, 2, 1])]):
        prompt = torch.randint(1, 63, (plen,), generator=g).tolist()
        rows += [(f"u{i}", prompt, torch.randint(1, 63, (r,), generator=g).tolist()) for r in rlens]
    order = [4, 0, 7, 2, 5, 1, 8, 3, 6]
    rows = [rows[i] for i in order]
    ids = torch.tensor([t for _, p, r in rows for t in p + r])
    cu = torch.cat(
        [torch.zeros(1, dtype=torch.long), torch.tensor([len(p) + len(r) for _, p, r in rows]).cumsum(0)]
    )
    return ids, cu, torch.tensor([len(r) for _, _, r in rows]), [u for u, _, _ in rows]


def test_the_backend_plans_a_packed_micro_batch_within_its_packed_tokens(model):
    """The engine hook's call: the backend's plan with ``packed=True`` splits the uid groups into
    grids holding no more than the packed tokens (one grid would pad to 3 x (6 + 4 x 9) = 126 of 56),
    with the same log-probs and gradients as one grid."""
    from grpo_parts.attention.shared_prefix import SharedPrefixAttention

    ids, cu, resp, uids = _uneven_micro_batch()
    call = attention.packed_call(ids, cu, resp, uids)
    bounded = SharedPrefixAttention(layout="grid")
    plan = bounded.plan(model, call.batch, packed=True)
    assert plan.packed_tokens == int(cu[-1]) == 56 and plan.tokens <= 56 < plan.single_grid_slots == 126
    assert len(plan.calls) == 3 and plan.padding_free_tokens == (3 + 6 + 2) + int(resp.sum())
    one = SharedPrefixAttention(layout="grid", max_chunks=1)
    assert len(one.plan(model, call.batch).calls) == 1
    where = _response_positions(cu, resp)
    outs = []
    for backend, p in ((one, None), (bounded, plan)):
        model.zero_grad()
        out = attention.run_packed(model, call, backend, 0.9, True, p)
        (out.log_probs[where] * torch.linspace(-1, 1, where.numel(), dtype=torch.float64)).sum().backward()
        outs.append((out, [q.grad.clone() for q in model.parameters()]))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=TOL)
    torch.testing.assert_close(a.entropy, b.entropy, rtol=0, atol=TOL)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=0, atol=TOL)


def test_merge_slack_is_refused_not_ignored():
    from grpo_parts_adapters.verl.options import EngineOptions

    with pytest.raises(ValueError, match="merge_slack"):
        EngineOptions(attention="shared_prefix", merge_slack=0.25)


def test_prefix_bench_token_accounting():
    """scripts/measure/verl_prefix_bench.py's exact token counts (the part of the benchmark a CPU can check):
    the grouped layout runs fewer tokens than verl's packed row when prompts repeat."""
    import argparse
    import importlib.util
    from pathlib import Path

    pytest.importorskip("verl")
    path = Path(__file__).resolve().parents[3] / "scripts" / "measure" / "verl_prefix_bench.py"
    spec = importlib.util.spec_from_file_location("verl_prefix_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(prompts=2, n=4, prompt_len=32, response_len=16, vocab=64, seed=0)
    got = {v: bench.token_stats(args, v) for v in bench.VARIANTS}
    data = bench.make_batch(args)
    assert got["verl_packed"]["model_tokens"] == data["input_ids"].values().numel()
    assert got["verl_pg"]["model_tokens"] <= got["ours"]["model_tokens"] < got["verl_packed"]["model_tokens"]
    assert got["verl_packed"]["model_tokens"] <= got["verl_padded"]["model_tokens"]
