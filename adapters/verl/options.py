"""``actor_rollout_ref.{actor,ref}.grpo_parts.*``: the attention options one verl engine carries,
from :class:`~.config.FSDPActorConfig` to the engine (:func:`options_of`). Imports neither (nor
verl), so the engine and the config depend on it and not on each other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from grpo_parts.parts_config import KnownFields, PartsConfig

#: attribute of verl's engine config that carries :class:`EngineOptions` to the engine
ENGINE_ATTR = "grpo_parts"
#: ``actor_rollout_ref.rollout.name`` of grpo_parts' rollout backend (:mod:`.rollout`; registered by
#: :mod:`.plugin`, which must not import the backend's module: that module imports verl)
ROLLOUT_NAME = "grpo_parts"


def hydra_value(value: Any) -> str:
    """A value as a Hydra command-line override writes it: ``null``/``true``/``false``, lists (a
    draft-length table) as nested lists, strings with Hydra's special characters quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str) and any(c in value for c in ":,=[]{} "):
        return "'" + value + "'"
    return str(value)


class EngineOptions(KnownFields):
    """``actor_rollout_ref.{actor,ref}.grpo_parts.*``; the key table is in docs/adapters/verl.md (the
    attention part). ``attention=None`` runs verl's own forward."""

    attention: str | None = None
    kernel: str = "auto"
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

    @property
    def parts(self) -> PartsConfig:
        """These options as the one parts configuration (``attention``; the shared-prefix keys are
        its ``attention_kwargs``)."""
        shared_prefix_keys = {"kernel", "max_chunks", "chunk_overhead_tokens", "layout", "varlen"}
        kwargs = self.model_dump(include=shared_prefix_keys) if self.attention == "shared_prefix" else {}
        return PartsConfig(attention=self.attention, attention_kwargs=kwargs)

    def backend(self) -> Any:
        """The grpo_parts ``AttentionBackend`` these options name (None when off), built by
        :func:`grpo_parts.build.build_attention`; the shared-prefix keys go to ``shared_prefix`` only."""
        from grpo_parts.build import build_attention

        parts = self.parts
        if parts.attention is None:
            return None
        return build_attention(parts.attention, kwargs=parts.attention_kwargs or None, where="grpo_parts")


def options_of(engine_config: Any) -> EngineOptions | None:
    """The :class:`EngineOptions` an engine config carries when attention is on, else None."""
    opts = getattr(engine_config, ENGINE_ATTR, None)
    return opts if isinstance(opts, EngineOptions) and opts.attention is not None else None
