"""Shared-prefix backend: soft-capping, packed inputs, and bad input -> clear errors."""

from __future__ import annotations

import pytest
import torch
from _attention_helpers import exact_model, pack, random_batch, use_exact_eager

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.packed import unpack
from grpo_parts.errors import GRPOPartsError, NotSupportedError

ATOL = 1e-10


def _grads(model, loss):  # type: ignore[no-untyped-def]
    return torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


def _assert_grads_close(model, ga, gb):  # type: ignore[no-untyped-def]
    for (name, _), a, b in zip(model.named_parameters(), ga, gb):
        if a is None and b is None:
            continue
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_gemma2_softcap_eager_kernel_exact():  # type: ignore[no-untyped-def]
    """Attention logit soft-capping: 'auto' refuses sdpa (and CPU flex with grad), runs eager."""
    model = use_exact_eager(exact_model("gemma2", vocab_size=48, num_kv_heads=2, attn_logit_softcapping=2.0))
    batch = random_batch(torch.Generator().manual_seed(2), [3, 2], vocab=48, max_prompt=6, max_completion=4)
    w = torch.rand(
        batch.completion_ids.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    ref = RepeatedPrefixAttention().completion_logprobs(model, batch).logprobs
    backend = SharedPrefixAttention()
    out = backend.completion_logprobs(model, batch).logprobs
    assert "chose kernel 'eager'" in backend.last_choice and "soft-capping" in backend.last_choice
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    _assert_grads_close(model, _grads(model, (out * w).sum()), _grads(model, (ref * w).sum()))
    with pytest.raises(NotSupportedError, match="soft-capping"):
        SharedPrefixAttention("sdpa").completion_logprobs(model, batch)


def test_packed_inputs_match_reference():  # type: ignore[no-untyped-def]
    model = exact_model("qwen3", vocab_size=48, num_kv_heads=2)
    batch = random_batch(
        torch.Generator().manual_seed(4), [2, 1, 3], vocab=48, max_prompt=5, max_completion=4
    )
    ids, cu, plens = pack(batch)
    ref = RepeatedPrefixAttention().completion_logprobs(model, batch).logprobs
    unpacked, rows, cols = unpack(ids.unsqueeze(0), cu, plens, batch.group_index)
    assert int(unpacked.completion_mask.sum()) == int(batch.completion_mask.sum()) == rows.numel()
    # rows, cols: the completion tokens in packed order, which is the batch's row-major order
    out = SharedPrefixAttention().completion_logprobs(model, unpacked).logprobs[rows, cols]
    expected = ref[batch.completion_mask.bool()]
    torch.testing.assert_close(out, expected.to(out.dtype), atol=ATOL, rtol=0)
    _assert_grads_close(model, _grads(model, out.sum()), _grads(model, expected.sum()))
    with pytest.raises(GRPOPartsError, match="cu_seqlens"):
        unpack(ids, cu[:-1], plens[:-1], batch.group_index[:-1])


def _batch(prompt_len=3, completion_mask=None, same_prompt=True):  # type: ignore[no-untyped-def]
    p = torch.tensor(
        [[5, 6, 7][:prompt_len], [5, 6, 7][:prompt_len] if same_prompt else [5, 6, 8][:prompt_len]]
    )
    cm = torch.ones(2, 2, dtype=torch.long) if completion_mask is None else completion_mask
    return LogprobBatch(p, torch.ones_like(p), torch.tensor([[1, 2], [3, 4]]), cm, torch.tensor([0, 0]))


def test_bad_inputs_raise_clear_errors():  # type: ignore[no-untyped-def]
    model = exact_model("llama", vocab_size=48, max_position_embeddings=4)
    sp = SharedPrefixAttention()
    with pytest.raises(
        GRPOPartsError, match=r"completion_mask: expected >= 1 completion token per row, row 1"
    ):
        sp.completion_logprobs(model, _batch(completion_mask=torch.tensor([[1, 1], [0, 0]])))
    with pytest.raises(GRPOPartsError, match=r"right-padded"):
        sp.completion_logprobs(model, _batch(completion_mask=torch.tensor([[1, 1], [0, 1]])))
    with pytest.raises(GRPOPartsError, match=r"max_position_embeddings=4"):
        sp.completion_logprobs(model, _batch())
    with pytest.raises(GRPOPartsError, match=r"different prompts"):
        sp.completion_logprobs(exact_model("llama", vocab_size=48), _batch(same_prompt=False))
    right_padded = LogprobBatch(
        torch.tensor([[5, 0]]),
        torch.tensor([[1, 0]]),
        torch.tensor([[1]]),
        torch.tensor([[1]]),
        torch.tensor([0]),
    )
    with pytest.raises(GRPOPartsError, match=r"left-padded"):
        sp.completion_logprobs(model, right_padded)
    with pytest.raises(GRPOPartsError, match=r"kernel"):
        SharedPrefixAttention("nope")


def test_refused_features():  # type: ignore[no-untyped-def]
    batch = random_batch(torch.Generator().manual_seed(1), [2], vocab=48, max_prompt=5, max_completion=4)
    long = int((batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)).max())
    windowed = exact_model("mistral", vocab_size=48, sliding_window=long - 1)
    reasons = SharedPrefixAttention().not_supported_reasons(windowed, batch)
    assert reasons and "sliding window" in reasons[0]
    with pytest.raises(NotSupportedError, match="sliding window"):
        SharedPrefixAttention().completion_logprobs(windowed, batch)
    ok = exact_model("mistral", vocab_size=48, sliding_window=long)  # window covers every sequence: exact
    torch.testing.assert_close(
        SharedPrefixAttention().completion_logprobs(ok, batch).logprobs,
        RepeatedPrefixAttention().completion_logprobs(ok, batch).logprobs,
        atol=ATOL,
        rtol=0,
    )
    model = exact_model("qwen2", vocab_size=48)
    with pytest.raises(NotSupportedError, match="no backward on CPU"):
        SharedPrefixAttention("flex").completion_logprobs(model, batch)
    assert SharedPrefixAttention().not_supported_reasons(torch.nn.Linear(2, 2))
