"""Building parts by name and the one-call helper :func:`make_trainer`."""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

import torch

from grpo_parts.errors import GRPOPartsError

from .options import TRLPartsOptions

if TYPE_CHECKING:
    from .trainer import GRPOPartsTrainer


def build_part(kind: str, spec: Any, model: torch.nn.Module, kwargs: dict[str, Any] | None = None) -> Any:
    """An instance stays as is; a name is looked up in the part's ``IMPLEMENTATIONS`` table and built
    with ``kwargs`` (plus the policy ``model`` where the constructor takes one)."""
    if spec is None or not isinstance(spec, str):
        if kwargs:
            raise GRPOPartsError(
                f"{kind}_kwargs: only used when {kind} is given by name, got {sorted(kwargs)}"
            )
        return spec
    mod = importlib.import_module(f"grpo_parts.{'filter' if kind == 'completion_filter' else kind}")
    getter = {"sampler": "get_sampler_class", "draft": "get_draft_class"}
    getter |= {"attention": "get_attention_class", "completion_filter": "get_filter_class"}
    cls = getattr(mod, getter[kind])(spec)
    kw = dict(kwargs or {})
    # samplers take the policy as ``model``; learnable drafts as ``policy`` (a frozen draft's
    # ``model`` is the draft LM itself, which the user must give in draft_kwargs)
    name = {"sampler": "model", "draft": "policy"}.get(kind)
    if name is not None and name in inspect.signature(cls).parameters and name not in kw:
        kw[name] = model
    return cls(**kw)


def make_trainer(
    model: Any,
    reward_funcs: Any,
    train_dataset: Any,
    processing_class: Any,
    *,
    args: Any = None,
    sampler: Any = None,
    draft: Any = None,
    attention: Any = None,
    completion_filter: Any = None,
    sampler_kwargs: dict[str, Any] | None = None,
    draft_kwargs: dict[str, Any] | None = None,
    attention_kwargs: dict[str, Any] | None = None,
    filter_kwargs: dict[str, Any] | None = None,
    parts_options: TRLPartsOptions | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    **config: Any,
) -> GRPOPartsTrainer:
    """One call: build a ``GRPOConfig`` from ``config`` (unless ``args`` is given) and a
    :class:`GRPOPartsTrainer` with the chosen parts. ``trainer_kwargs`` go to ``GRPOTrainer``."""
    if args is not None and config:
        raise GRPOPartsError(
            f"config: give either args=GRPOConfig(...) or GRPOConfig keywords, got both ({sorted(config)})"
        )
    from trl import GRPOConfig

    from .trainer import GRPOPartsTrainer

    return GRPOPartsTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args if args is not None else GRPOConfig(**config),
        train_dataset=train_dataset,
        processing_class=processing_class,
        sampler=sampler,
        draft=draft,
        attention=attention,
        completion_filter=completion_filter,
        sampler_kwargs=sampler_kwargs,
        draft_kwargs=draft_kwargs,
        attention_kwargs=attention_kwargs,
        filter_kwargs=filter_kwargs,
        parts_options=parts_options,
        **(trainer_kwargs or {}),
    )
