"""Building parts by name (:func:`build_part`, a thin call of :mod:`grpo_parts.build`) and the
one-call helper :func:`make_trainer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from grpo_parts import build as parts_build
from grpo_parts.errors import GRPOPartsError

from .options import PART_KEYWORDS, PartsConfig, TRLPartsOptions

if TYPE_CHECKING:
    from .trainer import GRPOPartsTrainer


def build_part(kind: str, spec: Any, model: torch.nn.Module, kwargs: dict[str, Any] | None = None) -> Any:
    """An instance (or ``None``: TRL's own path) stays as is; a name is built by
    :func:`grpo_parts.build.build_part` on the policy ``model`` with ``kwargs`` (a sampler's
    ``kwargs`` may carry its ``draft`` instance)."""
    kw = dict(kwargs or {})
    draft = kw.pop("draft", None) if kind == "sampler" and isinstance(spec, str) else None
    return parts_build.build_part(kind, spec, model, kwargs=kw, draft=draft)


def make_trainer(
    model: Any,
    reward_funcs: Any,
    train_dataset: Any,
    processing_class: Any,
    *,
    args: Any = None,
    parts: PartsConfig | dict[str, Any] | None = None,
    parts_options: TRLPartsOptions | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    **config: Any,
) -> GRPOPartsTrainer:
    """One call: build a ``GRPOConfig`` from ``config`` (unless ``args`` is given) and a
    :class:`GRPOPartsTrainer` with the chosen parts (the part keywords, :data:`~.options.PART_KEYWORDS`,
    among ``config``). ``trainer_kwargs`` go to ``GRPOTrainer``."""
    part_kw = {k: config.pop(k) for k in PART_KEYWORDS if k in config}
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
        **part_kw,
        parts=parts,
        parts_options=parts_options,
        **(trainer_kwargs or {}),
    )
