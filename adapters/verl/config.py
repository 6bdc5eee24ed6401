"""verl config keys that switch grpo_parts' shared-prefix log-probs on, per engine (actor, reference).

verl builds ``actor_rollout_ref.actor`` and ``actor_rollout_ref.ref`` with Hydra from their
``_target_`` dataclass, which rejects unknown keys. :class:`FSDPActorConfig` is verl's
``FSDPActorConfig`` plus one field, ``grpo_parts`` (:class:`EngineOptions`), so the switch is an
ordinary Hydra override list (see :func:`hydra_overrides` and docs/adapters/verl.md)::

    actor_rollout_ref.actor._target_=grpo_parts_adapters.verl.config.FSDPActorConfig
    +actor_rollout_ref.actor.grpo_parts.attention=shared_prefix
    actor_rollout_ref.ref._target_=grpo_parts_adapters.verl.config.FSDPActorConfig
    +actor_rollout_ref.ref.grpo_parts.attention=shared_prefix

The options travel with the engine config this actor/ref config hands to its FSDP engine
(``engine_config.grpo_parts``), the way verl itself hands the strategy over; the critic's config is
verl's ``CriticConfig`` and never carries them. Settings the shared-prefix path cannot honour are
refused here, when verl builds the config (the driver's ``validate_config`` for the actor, worker
start-up for the reference), with the reason -- never once per micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from verl.workers.config import FSDPActorConfig as _VerlFSDPActorConfig

from grpo_parts.errors import NotSupportedError

TARGET = "grpo_parts_adapters.verl.config.FSDPActorConfig"
#: attribute of verl's engine config that carries :class:`EngineOptions` to the engine
ENGINE_ATTR = "grpo_parts"


class EngineOptions(BaseModel):
    """``actor_rollout_ref.{actor,ref}.grpo_parts.*``.

    ``attention``: a grpo_parts attention backend (``shared_prefix``; ``reference`` re-encodes the
    prompt per row, for checking) or None (verl's own forward). ``kernel``: the shared-prefix
    kernel (``auto``, ``sdpa``, ``flex``, ``eager``). ``merge_slack``: a micro-batch's uid groups
    share one model call while its grouped layout stays within ``1 + merge_slack`` times the sum of
    their own layouts (0: a call per group; None: one call per micro-batch). ``max_padding_ratio``:
    run verl's own packed forward for a micro-batch whose grouped layouts would hold more than this
    many times its packed tokens (None: never). ``max_chunks`` / ``chunk_overhead_tokens``: the
    shared-prefix backend's grid splitting inside each call (:mod:`grpo_parts.attention.shared_prefix.chunking`;
    the data-parallel ranks agree on the number of model calls). ``layout``: the shared-prefix
    layout (``auto``, ``grid``, ``padding_free``; docs/attention.md). ``varlen``: the padding-free
    layout's varlen cascade kernel (False: the masked kernel, for A/B checks; counted as
    ``calls_masked_sdpa`` / ``calls_masked_eager``). See docs/adapters/verl.md, "Memory".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: str | None = None
    kernel: str = "auto"
    merge_slack: float | None = Field(0.25, ge=0)
    max_padding_ratio: float | None = Field(None, gt=0)
    max_chunks: int | None = Field(None, ge=1)
    chunk_overhead_tokens: int = 1024
    layout: str = "auto"
    varlen: bool = True

    @field_validator("attention")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        from grpo_parts.attention import IMPLEMENTATIONS

        if v is not None and v not in IMPLEMENTATIONS:
            raise ValueError(f"expected one of {sorted(IMPLEMENTATIONS)} or null, got {v!r}")
        return v

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> EngineOptions:
        return cls(**{str(k): v for k, v in dict(raw or {}).items()})

    def backend(self) -> Any:
        """The grpo_parts ``AttentionBackend`` these options name (None when off)."""
        from grpo_parts.attention import get_attention_class

        if self.attention is None:
            return None
        cls = get_attention_class(self.attention)
        if self.attention != "shared_prefix":
            return cls()
        return cls(
            kernel=self.kernel,
            max_chunks=self.max_chunks,
            chunk_overhead_tokens=self.chunk_overhead_tokens,
            layout=self.layout,
            varlen=self.varlen,
        )


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
        get = (
            model_config.get
            if hasattr(model_config, "get")
            else lambda k, d=None: getattr(model_config, k, d)
        )
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
            from .engine import install_engine_hook

            install_engine_hook()
        setattr(self.engine, ENGINE_ATTR, opts)  # a new attribute: verl's BaseConfig allows it

    def validate(self, n_gpus: int, train_batch_size: int, model_config: Any = None) -> None:
        super().validate(n_gpus, train_batch_size, model_config)
        opts = options_of(self.engine)
        if opts is not None and model_config is not None:
            reasons = startup_reasons(self, model_config)
            if reasons:
                raise NotSupportedError(f"grpo_parts.attention={opts.attention!r}", reasons)


def options_of(engine_config: Any) -> EngineOptions | None:
    """The :class:`EngineOptions` an engine config carries when attention is on, else None."""
    opts = getattr(engine_config, ENGINE_ATTR, None)
    return opts if isinstance(opts, EngineOptions) and opts.attention is not None else None


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
        out.append(
            f"+actor_rollout_ref.{role}.grpo_parts.attention={'null' if attention is None else attention}"
        )
        out += [f"+actor_rollout_ref.{role}.grpo_parts.{k}={v}" for k, v in options.items()]
    return out
