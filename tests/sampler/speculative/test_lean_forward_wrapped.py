"""The lean decode forward serves a policy as trainers hand it over (issue 38): accelerate's
mixed-precision wrapper (autocast + float32 outputs), TRL's fused LM head, transformers' gradient
checkpointing hook on the embedding, a training kernel left selected around the rollout. Each
reproduces the policy's own forward exactly (bitwise here: same ops under the same autocast); an
unknown wrapper is still refused, and a refusal is logged and counted per rollout."""

from __future__ import annotations

import logging
from types import MethodType

import pytest
import torch

from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.compat import output_cache, own_attention, select_attention
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.speculative.forward_chain import forward_chain
from grpo_parts.sampler.speculative.lean_forward import LeanForward, lean_forward_reasons
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.sampler.stats import DECODE_ATTENTION_REFUSED, LEAN_FORWARD_REFUSED
from grpo_parts.tiny import tiny_causal_lm


def _model(seed: int = 0) -> torch.nn.Module:
    m = tiny_causal_lm(
        "llama", vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        seed=seed, dtype=torch.float32, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)  # larger logits: differences would show
    return m.eval()


def _accelerate_prepare(m: torch.nn.Module, dtype: torch.dtype) -> None:
    """What ``Accelerator.prepare_model`` does to a model with ``mixed_precision`` (native AMP)."""
    pytest.importorskip("accelerate")  # not in the core suite's venv (plain `pip install -e .`)
    from accelerate.utils.operations import convert_outputs_to_fp32

    m._original_forward = m.forward
    m.forward = MethodType(torch.autocast(device_type="cpu", dtype=dtype)(m.forward.__func__), m)
    m.forward = MethodType(convert_outputs_to_fp32(m.forward.__func__), m)


def _trl_fused_head(m: torch.nn.Module) -> None:
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(m)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None])
def test_equals_the_wrapped_forward(fused: bool, dtype: torch.dtype | None) -> None:
    """Logits and hidden states equal (bitwise) what the wrapped forward returns, float32 as
    accelerate's wrapper converts them; without the autocast the logits would differ."""
    m = _model()
    if fused:
        _trl_fused_head(m)  # GRPOTrainer installs it first, accelerate wraps it
    if dtype is not None:
        _accelerate_prepare(m, dtype)
    m.gradient_checkpointing_enable()  # TRL's default: a hook on the embedding
    assert lean_forward_reasons(m) == []
    chain, why = forward_chain(m)
    assert why is None and chain is not None and bool(chain.autocasts) == (dtype is not None)
    ids = torch.randint(1, 24, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    inp, full = torch.randint(1, 24, (3, 2)), torch.cat([mask, torch.ones(3, 2, dtype=torch.long)], 1)
    pos2 = mask.sum(-1, keepdim=True) + torch.arange(2)
    with torch.inference_mode():
        c_ref = output_cache(m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True))
        c_lean = output_cache(m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True))
        ref = m(
            input_ids=inp, attention_mask=full, position_ids=pos2, past_key_values=c_ref, use_cache=True,
            output_hidden_states=True,
        )  # fmt: skip
        got = LeanForward(m)(inp, full, pos2, c_lean, need_h=True)
    assert got.logits.dtype == ref.logits.dtype == torch.float32
    assert torch.equal(got.logits, ref.logits)
    assert got.hidden_states is not None and torch.equal(got.hidden_states[-1], ref.hidden_states[-1])
    for a, b in zip(c_lean.layers, c_ref.layers, strict=True):  # type: ignore[attr-defined]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_unknown_wrappers_and_hooks_are_refused() -> None:
    m = _model()
    own = m.forward
    m.forward = lambda *a, **k: own(*a, **k)
    assert "forward is replaced on the instance (test_unknown" in " ".join(lean_forward_reasons(m))
    del m.forward
    h = m.model.layers[0].register_forward_hook(lambda *a: None)
    assert "forward hooks on 'model.layers.0'" in " ".join(lean_forward_reasons(m))
    h.remove()
    h = m.register_forward_pre_hook(lambda *a: None)  # the lean path never calls the top module
    assert "forward hooks on ''" in " ".join(lean_forward_reasons(m))
    h.remove()
    h = m.model.embed_tokens.register_forward_hook(lambda *a: None)  # called as a module: runs
    assert lean_forward_reasons(m) == []
    h.remove()


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


def test_rollout_under_a_training_kernel_and_wrappers_runs_both_paths() -> None:
    """TRL generates inside its training step, with the shared-prefix training kernel selected on
    the policy and the policy wrapped: the rollout still runs the lean forward and the decode
    kernel (own attention restored for it) and equals the unwrapped policy's rollout."""
    params = SamplingParams(group_size=4, max_new_tokens=10, temperature=1.0, eos_token_ids=(3,))
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    cfg = SpeculativeConfig(draft_tokens=2, decode_shared_prompt="always")
    plain = SpeculativeSampler(_model(1), NGramDraft(max_ngram=3), cfg)
    ref = plain.generate(prompts, params, torch.Generator().manual_seed(3))
    m = _model(1)
    _trl_fused_head(m)
    m.gradient_checkpointing_enable()
    spec = SpeculativeSampler(m, NGramDraft(max_ngram=3), cfg)
    kernel = SharedPrefixAttention().register_kernel()  # what GRPOPartsTrainer keeps selected
    assert kernel is not None
    with select_attention(m, kernel):
        out = spec.generate(prompts, params, torch.Generator().manual_seed(3))
        assert m.config._attn_implementation == kernel  # restored after the rollout
    assert own_attention(m.config) is None
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert out.stats["lean_forward_calls"] > 0 and out.stats["model_forward_calls"] == 0
    assert out.stats["decode_attention_shared_prefix_calls"] > 0
    assert out.stats[LEAN_FORWARD_REFUSED] == 0 and out.stats[DECODE_ATTENTION_REFUSED] == 0


def test_refusals_are_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    m = _model(2)
    own = m.forward
    m.forward = lambda *a, **k: own(*a, **k)
    spec = SpeculativeSampler(m, NGramDraft(max_ngram=3), SpeculativeConfig(draft_tokens=2))
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    with caplog.at_level(logging.INFO, logger="grpo_parts.sampler"):
        for g in (1, 1, 2):
            params = SamplingParams(group_size=g, max_new_tokens=6, temperature=1.0, eos_token_ids=(3,))
            out = spec.generate(prompts, params)
            assert out.stats[LEAN_FORWARD_REFUSED] == 1 and out.stats["lean_forward_calls"] == 0
            assert out.stats[DECODE_ATTENTION_REFUSED] == float(g == 1)
    lean = [r for r in caplog.records if "run the model's own forward" in r.message]
    assert len(lean) == 1 and lean[0].levelno == logging.WARNING and "replaced" in lean[0].message
    shared = [r for r in caplog.records if "every row's copy of the prompt" in r.message]
    assert len(shared) == 1 and shared[0].levelno == logging.INFO  # group_size 1: expected
    off = SpeculativeSampler(m, NGramDraft(), SpeculativeConfig(draft_tokens=2, lean_forward="off"))
    params = SamplingParams(group_size=2, max_new_tokens=4, temperature=1.0, eos_token_ids=(3,))
    assert off.generate(prompts, params).stats[LEAN_FORWARD_REFUSED] == 0  # turned off: not refused
