"""The prompt-skip stage's skipper behind a framework door: built by name and refused in one line
where the door's loss cannot stay unbiased under ``1 / p`` weights (:mod:`grpo_parts.core.unbiased`).
The stage that draws, weighs and observes is :class:`grpo_parts.skip.stage.SkipStage`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..build import build_prompt_skipper
from ..skip.protocol import PromptSkipper
from ..skip.stage import checked_skipper

__all__ = ["build_skipper"]


def build_skipper(
    spec: str | PromptSkipper,
    kwargs: Mapping[str, Any] | None,
    *,
    door: str,
    setting: str,
    reasons: Callable[[], list[str]],
) -> PromptSkipper | None:
    """The skipper ``spec`` names (an instance as is), None when it keeps every prompt; refused in one line
    under ``setting`` (the door's switch, e.g. ``--grpo_parts.prompt_skip``) when ``reasons()`` names a
    setting under which the door's loss is not unbiased (:func:`grpo_parts.skip.stage.checked_skipper`)."""
    skipper = build_prompt_skipper(spec, kwargs=dict(kwargs or {}) or None, where=f"{setting}_kwargs")
    return checked_skipper(skipper, door=door, setting=setting, reasons=reasons)
