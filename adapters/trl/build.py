"""Building parts by name (:func:`build_part`, a thin call of :mod:`grpo_parts.build`) and the
one-call helper :func:`make_trainer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from grpo_parts import build as parts_build
from grpo_parts.errors import GRPOPartsError

from .options import PartsConfig, TRLPartsOptions

if TYPE_CHECKING:
    from .trainer import GRPOPartsTrainer

#: ``build_part``'s ``kind`` -> (grpo_parts part, the trainer argument of its kwargs)
KINDS: dict[str, tuple[str, str]] = {
    "sampler": ("sampler", "sampler_kwargs"),
    "draft": ("draft", "draft_kwargs"),
    "attention": ("attention", "attention_kwargs"),
    "completion_filter": ("filter", "filter_kwargs"),
}


def build_part(kind: str, spec: Any, model: torch.nn.Module, kwargs: dict[str, Any] | None = None) -> Any:
    """An instance (or ``None``: TRL's own path) stays as is; a name is built by
    :func:`grpo_parts.build.build_part` on the policy ``model`` with ``kwargs`` (a sampler's
    ``kwargs`` may carry its ``draft`` instance)."""
    if kind not in KINDS:
        raise GRPOPartsError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
    part, where = KINDS[kind]
    kw = dict(kwargs or {})
    draft = kw.pop("draft", None) if part == "sampler" and isinstance(spec, str) else None
    return parts_build.build_part(part, spec, model, kwargs=kw, draft=draft, where=where)


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
    prompt_skip: Any = None,
    prompt_skip_kwargs: dict[str, Any] | None = None,
    parts: PartsConfig | dict[str, Any] | None = None,
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
        prompt_skip=prompt_skip,
        prompt_skip_kwargs=prompt_skip_kwargs,
        parts=parts,
        parts_options=parts_options,
        **(trainer_kwargs or {}),
    )
