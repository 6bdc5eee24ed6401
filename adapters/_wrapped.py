"""The model a grpo_parts backend inspects vs the module every model call goes through.

Frameworks hand the forward a *wrapped* model: DeepSpeed's engine, DDP, FSDP1, a PEFT model. Backends
read the transformers model's config, modules and forward signature, so they need the model inside.
But the wrapper's ``forward`` is not a pass-through: ``DeepSpeedEngine.forward`` registers the hooks
that start DeepSpeed's backward and, under ZeRO-3, advances the optimizer's ``micro_step_id`` (stuck
at 0, each accumulated micro-batch's gradient partition *replaced* the previous one); DDP's
``forward`` prepares the reducer for backward (gradient all-reduce, ``no_sync`` under gradient
accumulation); FSDP's unshards the parameters. :func:`backend_model` gives a backend the inner model
whose calls run through the wrapper.

Framework-free (no TRL/verl/OpenRLHF import), so every adapter can use it.
"""

from __future__ import annotations

from typing import Any

import torch


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DeepSpeed / DDP (``.module``) and PEFT (``get_base_model()``)
    wrappers: backends call it with keyword arguments its ``forward`` declares (``logits_to_keep``)."""
    from transformers import PreTrainedModel

    m = module
    for _ in range(4):
        if isinstance(m, PreTrainedModel):
            return m
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()  # type: ignore[operator]  # PEFT
            continue
        inner = getattr(m, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        m = inner
    return m


class _CallsThrough:
    """``model`` as a backend inspects it (config, modules, parameters, ``forward``'s signature),
    whose *calls* run through ``wrapper`` -- the engine / DDP / FSDP module around it -- as the
    framework's own forward calls the module it holds (see the module docstring for why)."""

    def __init__(self, wrapper: torch.nn.Module, model: torch.nn.Module) -> None:
        object.__setattr__(self, "_wrapper", wrapper)
        object.__setattr__(self, "_model", model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapper(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._model, name, value)


def backend_model(module: torch.nn.Module, inner: torch.nn.Module | None = None) -> Any:
    """What a backend gets as ``model``: ``inner`` (default :func:`hf_model` of ``module``), called
    through ``module`` (see :class:`_CallsThrough`) when ``module`` wraps it."""
    inner = hf_model(module) if inner is None else inner
    return inner if inner is module else _CallsThrough(module, inner)
