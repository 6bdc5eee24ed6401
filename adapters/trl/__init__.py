"""grpo_parts in TRL 1.16's ``GRPOTrainer`` (``pip install -e '.[trl]'``)::

    trainer = GRPOPartsTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                               processing_class=tok, sampler="speculative", attention="shared_prefix",
                               parts=PartsConfig(filter="cppo", refill_rounds=1))

TRL is imported on first use of :class:`GRPOPartsTrainer` / :func:`make_trainer`. docs/adapters/trl.md."""

from __future__ import annotations

from typing import Any

from .options import PartsConfig, TRLPartsOptions

__all__ = ["GRPOPartsTrainer", "PartsConfig", "TRLPartsOptions", "build_part", "make_trainer"]


def __getattr__(name: str) -> Any:
    if name == "GRPOPartsTrainer":
        from .trainer import GRPOPartsTrainer

        return GRPOPartsTrainer
    if name in ("make_trainer", "build_part"):
        from . import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
