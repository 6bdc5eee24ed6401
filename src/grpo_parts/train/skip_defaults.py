"""What ``grpo-parts train`` does about prompt skipping when the config does not say: decided here,
once, for the config (:func:`apply_skip_defaults`, before validation) and the ``--compare`` arms, and
said in the run's first lines (:func:`skip_notes`).

Skipping is opt-in (``parts.prompt_skip=history``): paired against the same run without it on two
finite pools, measured alone, it was sooner on neither (docs/results.md, "The finite-data default"),
so a finite-data run says so in one line and leaves it off.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ValidationError

from ..core import LossConfig
from ..skip.protocol import prompt_skip_reasons

log = logging.getLogger("grpo_parts.train")

#: what ``grpo-parts train`` trains when prompt skipping is on and ``loss.agg`` is left at its
#: default (token-mean, whose normaliser -- the drawn batch's token count -- is unknown for skipped
#: prompts): Dr. GRPO's token sum over a constant fixed before the draw, ``max_new_tokens`` per row.
#: Its gradient is token-mean's full-batch gradient times a positive per-step scale (total tokens /
#: (rows x max_new_tokens)), and with ``1 / p`` weights its estimate is unbiased (core/unbiased.py).
SKIP_DEFAULT_AGG = "seq-mean-token-sum-norm"
#: ``history``'s settings behind ``grpo-parts train`` when not given (the arm ``cppo+skip_strong``,
#: filling its steps): chosen by docs/results.md, "Which arm is fastest"
STRONG_RULE: dict[str, Any] = {"keep_base": 0.3, "base_step": 0.02, "target_share": 0.15}
TRAIN_HISTORY_KWARGS: dict[str, Any] = {**STRONG_RULE, "step_size": "fill"}
#: where the evidence for the finite-data default lives (the run's line points at it)
EVIDENCE = "docs/results.md#the-finite-data-default-54"


def skip_default_loss(loss: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    return {**loss, "agg": SKIP_DEFAULT_AGG, "norm_constant": loss.get("norm_constant", max_new_tokens)}


def _given(section: Any) -> tuple[dict[str, Any], set[str]] | None:
    """A config section's fields as given and their names (None: not a section; its field reports)."""
    if section is None:
        return {}, set()
    if isinstance(section, dict):
        return dict(section), set(section)
    if isinstance(section, BaseModel):
        return section.model_dump(exclude_unset=True), set(section.model_fields_set)
    return None


def _skip_loss(data: dict[str, Any], max_new_tokens: int) -> dict[str, Any] | None:
    """``loss`` as skipping trains it: as given, or :func:`skip_default_loss` when ``agg`` is not."""
    given = _given(data.get("loss"))
    if given is None:
        return None
    loss, names = given
    if "agg" in names:
        return loss
    return skip_default_loss(loss, data.get("max_new_tokens", max_new_tokens))


def finite_data(config: Any) -> bool:
    """Whether a config trains on a finite set that it goes over epoch after epoch: ``--data``, or a
    built-in task's ``task.train_size``."""
    return config.data is not None or getattr(config.task, "train_size", None) is not None


def skip_refusals(config: Any) -> list[str] | None:
    """Why skipping could not be unbiased with a config's advantage and the loss it would train with
    skipping on (:func:`_skip_loss`; None: that loss is invalid)."""
    try:
        loss = LossConfig.model_validate(_skip_loss({"loss": config.loss}, config.max_new_tokens))
    except ValidationError:
        return None
    return prompt_skip_reasons(config.advantage, loss, empty_rows=False)  # every row has >= 1 token


def apply_skip_defaults(data: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """``data`` (the config's fields as given, ``task`` filled in), and when ``parts.prompt_skip`` is
    ``history``, :data:`TRAIN_HISTORY_KWARGS` under the given kwargs and skipping's loss when
    ``loss.agg`` is not given. ``max_new_tokens``: the field's default."""
    parts = _given(data.get("parts"))
    if parts is None:
        return data
    fields, _ = parts
    loss = _skip_loss(data, max_new_tokens)
    if fields.get("prompt_skip", "none") == "none" or loss is None:
        return data
    if fields["prompt_skip"] == "history":
        kwargs = fields.get("prompt_skip_kwargs") or {}
        if isinstance(kwargs, dict):  # else the field reports it
            fields["prompt_skip_kwargs"] = {**TRAIN_HISTORY_KWARGS, **kwargs}
    return {**data, "parts": fields, "loss": loss}


def skip_notes(config: Any) -> list[str]:
    """The loss prompt skipping trains, or, on finite data where it was not asked for, that it is
    opt-in and why (one line, logged; config.yaml holds the same settings); ``config``: a validated
    ``TrainConfig`` (not imported here: the config module imports this one)."""
    if config.parts.prompt_skip == "none":
        if not finite_data(config) or "prompt_skip" in config.parts.model_fields_set:
            return []  # nothing could be skipped, or the user said so
        line = (
            "parts.prompt_skip: off (opt-in: paired on two finite pools it was sooner on neither, "
            f"{EVIDENCE}); --set parts.prompt_skip=history turns it on"
        )
        reasons = skip_refusals(config) or []
        if reasons:
            line += f", though not with this config: {reasons[0]}"
    else:
        loss = config.loss
        line = f"parts.prompt_skip={config.parts.prompt_skip!r}: loss.agg={loss.agg!r}"
        if loss.agg == SKIP_DEFAULT_AGG and loss.norm_constant is not None:
            line += (
                f", norm_constant={loss.norm_constant:g} (a normaliser fixed before the draw: token-mean's "
                "drawn-batch token count is unknown for skipped prompts; same gradient direction per step)"
            )
    log.info(line)
    return [line]
