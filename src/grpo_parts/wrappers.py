"""A policy under a training wrapper (DDP, FSDP1, DeepSpeed, ``DataParallel``, ``torch.compile``): the
model every part *inspects* vs the module every call of it *goes through*.

The parts read the inner transformers model (:func:`inner_model`), but a forward that feeds a
backward must run through the wrapper, whose ``forward`` is no pass-through (DDP's reducer, FSDP1's
unshard, DeepSpeed's backward hooks and ZeRO-3 ``micro_step_id``): :class:`CallsThrough`. Generation
needs only the weights (:func:`generation_model`); sharded weights need the ranks to run equally many
forwards (:func:`sharding`). Per wrapper: docs/attention.md, "Wrapped policies".
"""

from __future__ import annotations

from typing import Any

import torch

from .distributed import ranks_of

#: class name (anywhere in the wrapper's MRO) -> the name this module reports. Matched by name so
#: that DeepSpeed (and its subclasses: the hybrid and pipeline engines) is never imported here.
WRAPPERS = {
    "DistributedDataParallel": "DDP",
    "DataParallel": "DataParallel",
    "FullyShardedDataParallel": "FSDP1",
    "DeepSpeedEngine": "DeepSpeed",
    "OptimizedModule": "torch.compile",
}


class CallsThrough:
    """``model`` as a part inspects it (config, modules, ``forward``'s signature; attributes read and
    written on it), whose *calls* run through ``wrapper`` -- the DDP / FSDP1 / DeepSpeed module
    around it -- as the framework's own forward calls the module it holds. ``parameters()`` are the
    wrapper's where the inner model has none of its own (FSDP1 keeps them in flat parameters)."""

    # its own attributes are named so that they shadow none of the model's: ``view.model`` must be
    # the inner model's ``.model`` submodule (a VLM's ``get_rope_index`` lives there), as unwrapped
    def __init__(self, wrapper: torch.nn.Module, model: torch.nn.Module) -> None:
        object.__setattr__(self, "_calls_wrapper", wrapper)
        object.__setattr__(self, "_calls_model", model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._calls_wrapper(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._calls_model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._calls_model, name, value)

    def parameters(self, recurse: bool = True) -> Any:
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        own = list(self._calls_model.named_parameters(*args, **kwargs))
        return iter(own) if own else self._calls_wrapper.named_parameters(*args, **kwargs)


def wrapper_kind(module: Any) -> str | None:
    """What wraps ``module``'s inner model (a :data:`WRAPPERS` value; ``"calls-through"`` for a
    :class:`CallsThrough`), or None when ``module`` is no wrapper."""
    if isinstance(module, CallsThrough):
        return "calls-through"
    for cls in type(module).__mro__:
        if cls.__name__ in WRAPPERS:
            return WRAPPERS[cls.__name__]
    return None


def is_wrapper(module: Any) -> bool:
    return wrapper_kind(module) is not None


def _unwrap_once(module: Any) -> Any:
    kind = wrapper_kind(module)
    if kind == "calls-through":
        return module._calls_model
    if kind == "FSDP1":
        return module._fsdp_wrapped_module
    if kind == "torch.compile":
        return module._orig_mod
    return module.module  # DDP, DataParallel, DeepSpeed's engine


def wrapper_chain(module: Any) -> list[Any]:
    """``module`` and every wrapper below it, outermost first; the last entry is the inner model."""
    chain = [module]
    while is_wrapper(chain[-1]) and len(chain) < 16:
        chain.append(_unwrap_once(chain[-1]))
    return chain


def inner_model(module: Any) -> Any:
    """The model under every wrapper of :data:`WRAPPERS` (``module`` itself when it is none). A PEFT
    model stays a PEFT model: the parts inspect its adapter (see :func:`transformers_model`)."""
    return wrapper_chain(module)[-1]


def transformers_model(module: Any) -> Any:
    """The transformers model under the wrappers and under PEFT (``get_base_model()``) -- what the
    adapters hand the backends to inspect (``forward``'s keyword arguments: ``logits_to_keep``) --
    or, for a module that is neither, the module a ``.module`` attribute holds."""
    from transformers import PreTrainedModel

    m = module
    for _ in range(8):
        if isinstance(m, PreTrainedModel):
            return m
        if is_wrapper(m):
            m = _unwrap_once(m)
        elif callable(getattr(m, "get_base_model", None)):
            m = m.get_base_model()  # PEFT
        elif isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        else:
            break
    return m


def calls_through(module: Any, inner: Any = None) -> Any:
    """What a part gets as ``model``: ``inner`` (default :func:`inner_model`) called through
    ``module`` when ``module`` wraps it (:class:`CallsThrough`), else ``module`` itself."""
    if isinstance(module, CallsThrough) and inner is None:
        return module
    inner = inner_model(module) if inner is None else inner
    return inner if inner is module else CallsThrough(module, inner)


def model_name(module: Any) -> str:
    """The inner model's class name (for messages: never ``CallsThrough`` or ``DistributedDataParallel``)."""
    return type(inner_model(module)).__name__


def sharding(module: Any) -> str | None:
    """How ``module``'s weights are sharded across processes (``"FSDP1 FULL_SHARD"``, ``"FSDP2"``,
    ``"DeepSpeed ZeRO-3"``), or None when every rank holds them whole (DDP, ZeRO-0/1/2, FSDP1
    ``NO_SHARD``, one process)."""
    for m in wrapper_chain(module)[:-1]:
        kind = wrapper_kind(m)
        strategy = getattr(m, "sharding_strategy", None)
        if kind == "FSDP1" and strategy is not None and getattr(strategy, "name", "") != "NO_SHARD":
            return f"FSDP1 {strategy.name}"
        stage = getattr(m, "zero_optimization_stage", None)
        if kind == "DeepSpeed" and callable(stage) and int(stage()) >= 3:
            return "DeepSpeed ZeRO-3"
    for p in inner_model(module).parameters():
        if hasattr(p, "ds_id"):
            return "DeepSpeed ZeRO-3"
        if type(p).__name__ == "DTensor":
            return "FSDP2"
    return None


def generation_model(module: Any) -> tuple[Any, bool]:
    """``(what a sampler calls, whether the ranks must run their forwards together)``: the inner
    model (skipping DDP's forward also skips its per-forward buffer broadcast, which ranks decoding
    different numbers of steps could not match), except through FSDP1, whose forward unshards the
    parameters; sharded weights make the ranks step together (docs/attention.md, "Wrapped policies")."""
    kinds = [wrapper_kind(m) for m in wrapper_chain(module)[:-1]]
    sharded = sharding(module) is not None and ranks_of() > 1
    if "FSDP1" in kinds:
        return calls_through(module), sharded
    return inner_model(module), sharded
