"""One parts configuration for every door: which implementation of each Protocol runs, its kwargs,
and the three settings every door shares (refill, rounding the kept rows, keeping a prompt's rows
together). Each door maps its own spelling into this one class and adds only its defaults
(:data:`DOOR_DEFAULTS`) and its door-only settings (docs/doors.md, "One parts configuration", has the
table). ``None`` for ``sampler`` / ``attention`` means *the door's own path*. This module imports
only the skip table (when validating), so every door can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: the doors (docs/doors.md)
DOORS = ("train", "trl", "verl", "openrlhf")

#: what each door runs when a setting is not given, the one table every door reads. ``grpo-parts
#: train``: the optimized parts (prompt skipping is opt-in everywhere). The framework doors run their framework's own path for every part (the parts are opt-in); verl
#: switches each part on by its own key, and one switched on without a name runs these: the rollout
#: backend (``rollout.name=grpo_parts``) the sampler and draft, ``+grpo_parts.filter`` the filter.
#: A filter's own kwargs default in :data:`grpo_parts.build.DEFAULT_KWARGS`.
DOOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"sampler": "speculative", "draft": "ngram", "attention": "shared_prefix", "filter": "cppo"},
    "trl": {},
    "verl": {"sampler": "speculative", "draft": "ngram", "filter": "cppo"},
    "openrlhf": {},
}


class KnownFields(BaseModel):
    """A frozen pydantic config that refuses a field it does not have in one line naming the field and the
    valid ones (a misspelt or earlier name included: nothing old is read). Every door's config is one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _only_known_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(str(k) for k in data if k not in cls.model_fields)
            if unknown:
                raise ValueError(f"{unknown[0]}: unknown field; expected one of {sorted(cls.model_fields)}")
        return data


class PartsConfig(KnownFields):
    """Which part runs for each Protocol, by its ``IMPLEMENTATIONS`` name, and the settings every
    door shares.

    ``sampler`` / ``attention``: None = the door's own path. ``draft``: only for samplers that take
    one. ``filter``: a ``CompletionFilter`` (``keep_all`` = none). ``prompt_skip``: the stage before
    rollout that skips prompts whose recent groups had zero reward variance (``history``: kept
    prompts weigh ``1 / p``, unbiased; ``none``: every prompt is rolled out). ``*_kwargs`` go to the
    part's constructor (:mod:`grpo_parts.build`).

    ``refill_rounds``: when the filter keeps fewer completions than a full batch, roll out the extra
    prompts it asks for, up to this many extra rounds per step (0: no refill).
    ``kept_rounding``: a framework that needs the kept rows to be a multiple of its optimizer step
    (TRL's ``steps_per_generation``, verl's mini-batch and ranks, OpenRLHF's ``--train.batch_size``)
    gets them rounded ``up`` (the best pruned rows go back) or ``down`` (the worst kept rows are
    dropped; a weighted filter always rounds up: dropping drawn rows biases it).
    ``group_rows``: keep each prompt's completions in one training micro-batch, so a shared-prefix
    backend has a prefix to share (None: on when an attention backend is set and the framework's
    loss does not depend on the micro-batch; ``grpo-parts train`` always does).
    """

    sampler: str | None = None
    draft: str | None = None
    attention: str | None = None
    filter: str = "keep_all"
    prompt_skip: str = "none"
    sampler_kwargs: dict[str, Any] = Field(default_factory=dict)
    draft_kwargs: dict[str, Any] = Field(default_factory=dict)
    attention_kwargs: dict[str, Any] = Field(default_factory=dict)
    filter_kwargs: dict[str, Any] = Field(default_factory=dict)
    prompt_skip_kwargs: dict[str, Any] = Field(default_factory=dict)
    refill_rounds: int = Field(0, ge=0, le=64)
    kept_rounding: Literal["up", "down"] = "up"
    group_rows: bool | None = None

    @field_validator("prompt_skip")
    @classmethod
    def _prompt_skip(cls, name: str) -> str:
        from .skip import IMPLEMENTATIONS

        if name not in IMPLEMENTATIONS:
            raise ValueError(f"expected one of {sorted(IMPLEMENTATIONS)} (a prompt skipper)")
        return name

    @classmethod
    def for_door(cls, door: str, given: Mapping[str, Any] | PartsConfig | None = None) -> PartsConfig:
        """``door``'s defaults (:data:`DOOR_DEFAULTS`) under the settings ``given`` (a config's
        given fields win, its unset ones take the door's default)."""
        if door not in DOOR_DEFAULTS:
            raise ValueError(f"door: expected one of {list(DOORS)}, got {door!r}")
        if isinstance(given, PartsConfig):
            given = given.model_dump(include=given.model_fields_set)
        return cls(**{**DOOR_DEFAULTS[door], **dict(given or {})})

    def refusals(self, door: str, offered: Mapping[str, str]) -> list[str]:
        """One line per setting that ``door`` does not offer but is set (``offered``: the settings
        it does not take -> what to use there instead)."""
        default = PartsConfig.for_door(door)
        return [
            f"{key}={getattr(self, key)!r}: not offered behind {door}; {instead}"
            for key, instead in offered.items()
            if getattr(self, key) != getattr(default, key)
        ]
