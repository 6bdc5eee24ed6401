"""verl config keys that switch grpo_parts' shared-prefix log-probs on, per engine (actor, reference):
:class:`FSDPActorConfig` is verl's ``FSDPActorConfig`` plus ``grpo_parts`` (:class:`EngineOptions`; Hydra's
``_target_`` dataclass rejects unknown keys), which reaches the FSDP engine as ``engine_config.grpo_parts``.
Settings the shared-prefix path cannot honour are refused once, when verl builds the config; Hydra builds
it in the worker before the engine (nothing else of ours runs there), so ``__post_init__`` installs the
engine hook. docs/adapters/verl.md, the attention part."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from verl.workers.config import FSDPActorConfig as _VerlFSDPActorConfig

from grpo_parts.errors import NotSupportedError

from .options import ENGINE_ATTR, EngineOptions, hydra_value, options_of

TARGET = "grpo_parts_adapters.verl.config.FSDPActorConfig"

__all__ = [
    "ENGINE_ATTR",
    "TARGET",
    "EngineOptions",
    "FSDPActorConfig",
    "hydra_overrides",
    "options_of",
    "startup_reasons",
]


def startup_reasons(config: Any, model_config: Any = None) -> list[str]:
    """Why the shared-prefix path cannot run under this actor/ref config (and model config)."""
    reasons = []
    strategy = getattr(config, "strategy", "fsdp")
    if strategy not in ("fsdp", "fsdp2"):
        reasons.append(f"strategy: expected 'fsdp' or 'fsdp2' (the FSDP engine is patched), got {strategy!r}")
    engine = getattr(config, "engine", None)
    sp = max(
        int(getattr(config, "ulysses_sequence_parallel_size", 1) or 1),
        int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1),
    )
    if sp > 1:
        reasons.append(
            f"ulysses_sequence_parallel_size={sp}: Ulysses shards each packed micro-batch's tokens across "
            "ranks before the model runs, while the grouped layout needs all of a group's tokens on one "
            "rank (use 1, or grpo_parts.attention=null)"
        )
    if getattr(config, "use_prefix_grouper", False):
        reasons.append(
            "use_prefix_grouper=True: verl's own Prefix Grouper and grpo_parts attention exclude each other"
        )
    fused = getattr(config, "use_fused_kernels", False)
    if model_config is not None:
        get = getattr(model_config, "get", None) or partial(getattr, model_config)
        fused = fused or bool(get("use_fused_kernels", False))
    if fused:
        reasons.append(
            "use_fused_kernels=True: the fused kernels compute log-probs inside the model's forward, which "
            "the shared-prefix path replaces (set actor_rollout_ref.model.use_fused_kernels=False)"
        )
    return reasons


@dataclass
class FSDPActorConfig(_VerlFSDPActorConfig):
    """verl's ``FSDPActorConfig`` plus ``grpo_parts`` (:class:`EngineOptions`) for its engine."""

    grpo_parts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        opts = EngineOptions.from_mapping(self.grpo_parts)
        if opts.attention is not None:
            reasons = startup_reasons(self)
            if reasons:
                raise NotSupportedError(f"grpo_parts.attention={opts.attention!r}", reasons)
            from .engine import install_engine_hook  # where this engine is set up: see the module doc

            install_engine_hook()
        setattr(self.engine, ENGINE_ATTR, opts)  # a new attribute: verl's BaseConfig allows it

    def validate(self, n_gpus: int, train_batch_size: int, model_config: Any = None) -> None:
        super().validate(n_gpus, train_batch_size, model_config)
        opts = options_of(self.engine)
        if opts is not None and model_config is not None:
            reasons = startup_reasons(self, model_config)
            if reasons:
                raise NotSupportedError(f"grpo_parts.attention={opts.attention!r}", reasons)


def hydra_overrides(
    attention: str | None = "shared_prefix", *, ref: bool = True, **options: Any
) -> list[str]:
    """The Hydra overrides of ``python -m verl.trainer.main_ppo`` that switch the attention part on
    for the actor (and the reference when ``ref``), with further :class:`EngineOptions` keys."""
    EngineOptions(attention=attention, **options)  # validate early
    roles = ["actor", "ref"] if ref else ["actor"]
    out = []
    for role in roles:
        out.append(f"actor_rollout_ref.{role}._target_={TARGET}")
        out.append(f"+actor_rollout_ref.{role}.grpo_parts.attention={hydra_value(attention)}")
        out += [f"+actor_rollout_ref.{role}.grpo_parts.{k}={v}" for k, v in options.items()]
    return out
