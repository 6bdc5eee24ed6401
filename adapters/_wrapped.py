"""The model a grpo_parts backend inspects vs the module every model call goes through, for the
adapters: :mod:`grpo_parts.wrappers` (the one place that knows DeepSpeed's engine, DDP, FSDP1 and
PEFT), under the names the adapters use.

* :func:`hf_model` -- the transformers model under DeepSpeed / DDP / FSDP1 (and PEFT's
  ``get_base_model()``): backends call it with keyword arguments its ``forward`` declares
  (``logits_to_keep``); :func:`grpo_parts.wrappers.transformers_model`.
* :func:`backend_model` -- what a backend gets as ``model``: that inner model, called through the
  wrapper (its forward prepares DDP's reducer, unshards FSDP's parameters, registers DeepSpeed's
  backward hooks); :func:`grpo_parts.wrappers.calls_through`.

Framework-free (no TRL/verl/OpenRLHF import), so every adapter can use it.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_parts.wrappers import calls_through, transformers_model


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under the wrappers and PEFT (:func:`grpo_parts.wrappers.transformers_model`)."""
    return transformers_model(module)  # type: ignore[no-any-return]


def backend_model(module: torch.nn.Module, inner: torch.nn.Module | None = None) -> Any:
    """What a backend gets as ``model``: ``inner`` (default :func:`hf_model` of ``module``), called
    through ``module`` when ``module`` wraps it (:class:`grpo_parts.wrappers.CallsThrough`)."""
    return calls_through(module, hf_model(module) if inner is None else inner)
