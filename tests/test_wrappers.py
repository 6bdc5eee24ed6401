"""grpo_parts.wrappers without a process group: which modules are wrappers, the inner model under
nested wrappers and PEFT, the CallsThrough view (inspects the inner model, calls the wrapper), what
counts as sharded. Wrapped models in the parts:
tests/attention/shared_prefix/test_wrapped.py (one rank) and test_wrapped_ranks.py (two)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo_parts.tiny import tiny_causal_lm
from grpo_parts.wrappers import (
    CallsThrough,
    calls_through,
    generation_model,
    inner_model,
    is_wrapper,
    model_name,
    sharding,
    transformers_model,
    wrapper_chain,
    wrapper_kind,
)


class DeepSpeedEngine(torch.nn.Module):
    """Stands in for ``deepspeed.DeepSpeedEngine`` (matched by class name: never imported)."""

    def __init__(self, module: torch.nn.Module, stage: int) -> None:
        super().__init__()
        self.module, self.stage = module, stage

    def zero_optimization_stage(self) -> int:
        return self.stage

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.module(*args, **kwargs)


class HybridEngine(DeepSpeedEngine):
    """A subclass (DeepSpeed's hybrid / pipeline engines): found through the MRO."""


def test_wrappers_and_their_inner_model():  # type: ignore[no-untyped-def]
    model = tiny_causal_lm("llama", vocab_size=48)
    dp = torch.nn.DataParallel(model)
    engine = HybridEngine(dp, stage=2)
    assert [wrapper_kind(m) for m in wrapper_chain(engine)] == ["DeepSpeed", "DataParallel", None]
    assert inner_model(engine) is model and inner_model(model) is model
    assert is_wrapper(engine) and not is_wrapper(model)
    assert model_name(engine) == "LlamaForCausalLM"
    compiled = torch.compile(model)
    assert wrapper_kind(compiled) == "torch.compile" and inner_model(compiled) is model


def test_calls_through_inspects_the_inner_model_and_calls_the_wrapper():  # type: ignore[no-untyped-def]
    model = tiny_causal_lm("llama", vocab_size=48)
    engine = DeepSpeedEngine(model, stage=2)
    calls: list[str] = []
    engine.register_forward_pre_hook(lambda m, a, k: calls.append("engine"), with_kwargs=True)
    view = calls_through(engine)
    assert isinstance(view, CallsThrough) and calls_through(view) is view
    assert view.config is model.config and inner_model(view) is model
    assert list(view.parameters()) == list(model.parameters())
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(view(input_ids=ids).logits, model(input_ids=ids).logits)
    assert calls == ["engine"]  # the call went through the wrapper
    view.some_flag = 3  # attributes are written on the inner model
    assert model.some_flag == 3
    assert calls_through(model) is model  # no wrapper: the model itself


def test_calls_through_parameters_fall_back_to_the_wrapper():  # type: ignore[no-untyped-def]
    """FSDP1 (``use_orig_params=False``) moves the inner modules' parameters into flat parameters
    on the wrapper: a view's parameters are then the wrapper's."""
    inner, wrapper = torch.nn.Module(), torch.nn.Linear(2, 2)
    view = CallsThrough(wrapper, inner)
    assert list(view.parameters()) == list(wrapper.parameters())


def test_calls_through_shadows_none_of_the_models_attributes():  # type: ignore[no-untyped-def]
    """``view.model`` is the inner model's ``.model`` submodule, as unwrapped (a VLM's
    ``get_rope_index`` lives there: a view that answered with the whole model put a wrapped VLM's
    completions at text positions, caught by tests/adapters/trl/test_trl_vlm_ranks.py)."""
    inner = tiny_causal_lm("llama", vocab_size=48)
    view = CallsThrough(torch.nn.Module(), inner)
    assert view.model is inner.model and inner_model(view) is inner


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_transformers_model_goes_below_peft():  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model

    model = tiny_causal_lm("llama", vocab_size=48)
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    engine = DeepSpeedEngine(peft, stage=1)
    assert inner_model(engine) is peft  # the parts inspect the adapter (prompt learning is refused)
    assert transformers_model(engine) is model


def test_sharding():  # type: ignore[no-untyped-def]
    model = tiny_causal_lm("llama", vocab_size=48)
    assert sharding(model) is None and sharding(DeepSpeedEngine(model, stage=2)) is None
    assert sharding(DeepSpeedEngine(model, stage=3)) == "DeepSpeed ZeRO-3"
    assert generation_model(DeepSpeedEngine(model, stage=3)) == (model, False)  # one process: no peers
    p = next(model.parameters())
    p.ds_id = 0  # what ZeRO-3 puts on its partitioned parameters
    assert sharding(model) == "DeepSpeed ZeRO-3"
