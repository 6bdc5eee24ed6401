"""A wrapped policy in the public API, one process (a world-size-1 gloo group, torn down after the
module): the reference and shared-prefix backends and the samplers take DDP / FSDP1 wrapped models
and give the bare model's numbers (log-probs, entropies, gradients, rollouts); the inner model is
inspected, the forward runs through the wrapper. Two processes: test_wrapped_ranks.py."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
from _attention_helpers import exact_model, random_batch
from multirank import free_port

from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.draft.eagle import EagleDraft
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative import SpeculativeConfig, SpeculativeSampler
from grpo_parts.wrappers import CallsThrough, generation_model, inner_model, sharding


@pytest.fixture(scope="module")
def one_rank():  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wrap(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"))  # flat parameters


def _outputs(backend, model, batch):  # type: ignore[no-untyped-def]
    out = backend.completion_logprobs(model, batch, temperature=0.7, compute_entropy=True)
    adv = torch.linspace(-1, 1, out.logprobs.shape[0], dtype=torch.float64)[:, None]
    ((out.logprobs * adv).sum() + 0.1 * out.entropies.sum()).backward()
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp1"])
@pytest.mark.parametrize("backend", [RepeatedPrefixAttention, SharedPrefixAttention])
def test_backends_take_a_wrapped_model(one_rank, kind, backend):  # type: ignore[no-untyped-def]
    bare = exact_model("qwen2", vocab_size=48, num_kv_heads=2)
    wrapped = _wrap(kind, copy.deepcopy(bare))
    batch = random_batch(
        torch.Generator().manual_seed(1), [3, 1, 2], vocab=48, max_prompt=6, max_completion=5
    )
    assert backend().not_supported_reasons(wrapped, batch) == []
    calls: list[int] = []
    wrapped.register_forward_pre_hook(lambda m, a: calls.append(1))
    got, want = _outputs(backend(), wrapped, batch), _outputs(backend(), bare, batch)
    assert calls  # every forward went through the wrapper
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.entropies, want.entropies)
    if kind == "fsdp1":  # flat parameters: FSDP1's gradients are compared in test_wrapped_ranks.py
        return
    grads = dict(wrapped.module.named_parameters())
    for name, p in bare.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=0, rtol=0, msg=name)


def _prompts() -> PromptBatch:
    ids = torch.randint(1, 48, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return PromptBatch(ids, mask)


@pytest.mark.parametrize("kind", ["ddp", "fsdp1"])
def test_reference_sampler_takes_a_wrapped_model(one_rank, kind):  # type: ignore[no-untyped-def]
    bare = exact_model("qwen2", vocab_size=48, num_kv_heads=2)
    wrapped = _wrap(kind, copy.deepcopy(bare))
    params = SamplingParams(group_size=2, max_new_tokens=5, eos_token_ids=(3,))
    got = ReferenceSampler(wrapped).generate(_prompts(), params, torch.Generator().manual_seed(2))
    want = ReferenceSampler(bare).generate(_prompts(), params, torch.Generator().manual_seed(2))
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    model, lockstep = generation_model(wrapped)
    assert not lockstep  # one rank: nobody to wait for
    # DDP: the inner model (whole weights, no collectives); FSDP1: through the wrapper (it unshards)
    assert isinstance(model, CallsThrough) == (kind == "fsdp1")


@pytest.mark.parametrize("kind", ["ddp", "fsdp1"])
def test_speculative_sampler_and_drafts_take_a_wrapped_model(one_rank, kind):  # type: ignore[no-untyped-def]
    """Whole weights under the wrapper (DDP; FSDP1 on one rank, which does not shard): the decode
    loop runs the inner model, the EAGLE head reads the inner lm_head."""
    bare = exact_model("qwen2", vocab_size=48, num_kv_heads=2)
    wrapped = _wrap(kind, copy.deepcopy(bare))
    assert sharding(wrapped) is None  # (FSDP1 switches to NO_SHARD on one rank)
    params = SamplingParams(group_size=2, max_new_tokens=6)
    cfg = SpeculativeConfig(draft_tokens=2)
    gen = torch.Generator
    got = SpeculativeSampler(wrapped, NGramDraft(), cfg).generate(_prompts(), params, gen().manual_seed(4))
    want = SpeculativeSampler(bare, NGramDraft(), cfg).generate(_prompts(), params, gen().manual_seed(4))
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    draft = EagleDraft(wrapped)
    assert draft.not_supported_reasons(wrapped, params) == []
    assert draft.lm_head is inner_model(wrapped).lm_head


def test_sharded_policies_are_refused_where_the_loop_runs_the_layers(one_rank):  # type: ignore[no-untyped-def]
    """Sharded weights (FSDP2 here; FSDP1 and ZeRO-3 alike) are shards outside the forward: the
    speculative decode loop and the EAGLE head (which read the layers and the lm_head directly)
    refuse them, naming the sharding; the reference sampler and the backends take them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    bare = exact_model("qwen2", vocab_size=48, num_kv_heads=2)
    model = fully_shard(copy.deepcopy(bare), mesh=init_device_mesh("cpu", (1,)))
    assert sharding(model) == "FSDP2"
    with pytest.raises(NotSupportedError, match="weights sharded by FSDP2"):
        SpeculativeSampler(model, NGramDraft())
    with pytest.raises(GRPOPartsError, match="weights sharded by FSDP2"):
        EagleDraft(model)
    params = SamplingParams(group_size=2, max_new_tokens=4)
    got = ReferenceSampler(model).generate(_prompts(), params, torch.Generator().manual_seed(2))
    want = ReferenceSampler(bare).generate(_prompts(), params, torch.Generator().manual_seed(2))
    assert torch.equal(got.completion_ids, want.completion_ids)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_autocast_forward(one_rank):  # type: ignore[no-untyped-def]
    """accelerate's prepared model on one process is the model itself with an autocast-wrapped
    ``forward`` (bf16, outputs cast to float32): inspected and called as it is."""
    pytest.importorskip("accelerate")  # not in the core suite's venv (plain `pip install -e .`)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from grpo_parts.tiny import tiny_causal_lm

    # accelerate's state is a process-wide singleton: an earlier test (TRL's trainer) may have set
    # it up without mixed precision, and Accelerator() refuses to change it. Reset it around this test.
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare(
            tiny_causal_lm("llama", vocab_size=48)
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    batch = random_batch(
        torch.Generator().manual_seed(1), [3, 1, 2], vocab=48, max_prompt=6, max_completion=5
    )
    assert SharedPrefixAttention().not_supported_reasons(prepared, batch) == []
    with torch.no_grad():
        out = SharedPrefixAttention().completion_logprobs(prepared, batch).logprobs
        ref = RepeatedPrefixAttention().completion_logprobs(prepared, batch).logprobs
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=0)  # bf16 precision, as under torch.autocast
