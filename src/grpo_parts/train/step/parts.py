"""Build the five parts from :class:`~grpo_parts.parts_config.PartsConfig` by name, through
:mod:`grpo_parts.build`, with the rules of ``grpo-parts train`` alone: a *default* name missing from
this installation falls back to the reference with a logged note (its kwargs dropped), while a name
the user set must exist."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...build import (
    build_attention,
    build_draft,
    build_filter,
    build_prompt_skipper,
    build_sampler,
    implementations,
    takes_draft,
)
from ...errors import GRPOPartsError, NotSupportedError
from ...parts_config import DOOR_DEFAULTS
from ...sampler import get_sampler_class
from ...sampler.protocol import image_prompt_reasons
from ...skip.protocol import PromptSkipper
from ...skip.reference import KeepEveryPrompt
from ..config import REFERENCE_PARTS, PartsConfig

log = logging.getLogger("grpo_parts.train")

__all__ = ["Parts", "build_parts", "resolve_name"]


@dataclass
class Parts:
    sampler: Any
    attention: Any
    filter: Any
    draft: Any | None = None
    names: dict[str, str | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    prompt_skip: PromptSkipper = field(default_factory=KeepEveryPrompt)  # before rollout: none = keep all

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.names.items())

    def with_state(self) -> dict[str, Any]:
        """The parts a checkpoint may carry state for, under their checkpoint keys."""
        return {key: getattr(self, key) for key in ("draft", "sampler", "filter", "prompt_skip")}


def resolve_name(
    part: str, cfg: PartsConfig, notes: list[str], defaults: Mapping[str, Any] = DOOR_DEFAULTS["train"]
) -> str | None:
    """The implementation name to use for ``part`` (``None`` only for ``draft``; a sampler or
    attention of None -- the door's own path -- is this door's reference)."""
    name = getattr(cfg, part)
    if name is None:
        return None if part == "draft" else REFERENCE_PARTS[part]
    table = implementations(part)
    if name in table:
        return str(name)
    if name != defaults.get(part):  # set by the user: it must exist
        raise GRPOPartsError(
            f"parts.{part}: unknown implementation {name!r}; expected one of {sorted(table)}"
        )
    fallback = REFERENCE_PARTS[part]
    note = f"parts.{part}: {name!r} is not available in this installation; using the reference {fallback!r}"
    log.warning(note)
    notes.append(note)
    return fallback


def _kwargs(part: str, name: str, cfg: PartsConfig) -> dict[str, Any]:
    """``parts.<part>_kwargs``, or none when ``name`` is a fallback (they were meant for the part
    that is missing; the builder then uses the fallback's default kwargs)."""
    return dict(getattr(cfg, f"{part}_kwargs")) if getattr(cfg, part) == name else {}


def build_parts(
    cfg: PartsConfig,
    policy: torch.nn.Module,
    images: bool = False,
    defaults: Mapping[str, Any] = DOOR_DEFAULTS["train"],
) -> Parts:
    """The parts ``cfg`` names. ``images``: the prompts carry images; a sampler that cannot roll
    them out is the reference's (noted) when it is the default, refused with its reason when set."""
    notes: list[str] = []
    names = {p: resolve_name(p, cfg, notes, defaults) for p in ("sampler", "draft", "attention", "filter")}
    sampler_name = names["sampler"]
    assert sampler_name is not None
    reasons = image_prompt_reasons(get_sampler_class(sampler_name)) if images else []
    if reasons:  # decided before anything is built (a draft for a sampler that will not run)
        if cfg.sampler != defaults.get("sampler"):  # set by the user: refused
            raise NotSupportedError(f"parts.sampler {sampler_name!r}", reasons)
        note = f"parts.sampler: the default {sampler_name!r} does not take image prompts ({reasons[0]}); using the reference"
        log.warning(note)
        notes.append(note)
        sampler_name = names["sampler"] = "reference"
    draft = None
    if takes_draft(get_sampler_class(sampler_name)):
        if names["draft"] is None:
            raise GRPOPartsError(f"parts.draft: sampler {sampler_name!r} needs a draft, got None")
        draft_kw = _kwargs("draft", names["draft"], cfg)
        draft = build_draft(names["draft"], policy, kwargs=draft_kw, where="parts.draft_kwargs")
    else:
        names["draft"] = None
    skw = _kwargs("sampler", sampler_name, cfg)
    if sampler_name == "speculative":
        skw.setdefault("train_draft", False)  # the loop trains the draft itself (and times it)
    sampler = build_sampler(sampler_name, policy, draft=draft, kwargs=skw, where="parts.sampler_kwargs")
    attention_name, filter_name = str(names["attention"]), str(names["filter"])
    akw = _kwargs("attention", attention_name, cfg)
    attention = build_attention(attention_name, policy, kwargs=akw, where="parts.attention_kwargs")
    filt = build_filter(filter_name, kwargs=_kwargs("filter", filter_name, cfg), where="parts.filter_kwargs")
    reasons = attention.not_supported_reasons(policy)
    if reasons:
        raise NotSupportedError(f"attention {names['attention']!r}", reasons)
    skipper = build_prompt_skipper(
        cfg.prompt_skip, kwargs=cfg.prompt_skip_kwargs, where="parts.prompt_skip_kwargs"
    )
    if cfg.prompt_skip != "none":
        names["prompt_skip"] = cfg.prompt_skip
    return Parts(sampler, attention, filt, draft, names, notes, skipper)
