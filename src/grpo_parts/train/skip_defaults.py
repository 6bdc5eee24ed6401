"""What ``grpo-parts train`` does about prompt skipping when the config does not say: decided here,
once, for the config (:class:`~.config.TrainConfig` calls :func:`apply_skip_defaults` before it
validates) and the ``--compare`` arms; the run's log line is ``lifecycle.run.skip_notes``.

- **Its settings.** ``history`` behind this door takes :data:`TRAIN_HISTORY_KWARGS` under the
  given ``parts.prompt_skip_kwargs``: the arm that reached the target soonest on the finite pool
  with a hard tail (docs/results.md). The frameworks train whole steps of a fixed prompt count, so
  behind them a skip is filled (the skipper's own defaults, GRESO's rule).
- **Its loss.** With skipping on and ``loss.agg`` not given, the loss is :data:`SKIP_DEFAULT_AGG`
  with ``norm_constant = max_new_tokens``: token-mean divides by the drawn batch's token count, which
  is unknown for skipped prompts.
- **Off unless asked, on finite data too.** On the easier pool one seed in three of the fastest
  arm ended 16 points under CPPO (the ``1 / p`` weights' variance), so skipping is not switched on
  by default anywhere (docs/results.md).
"""

from __future__ import annotations

from typing import Any

from ..core import LossConfig
from ..parts_config import PartsConfig

#: what ``grpo-parts train`` trains when prompt skipping is on and ``loss.agg`` is left at its
#: default (token-mean, whose normaliser -- the drawn batch's token count -- is unknown for skipped
#: prompts): Dr. GRPO's token sum over a constant fixed before the draw, ``max_new_tokens`` per row.
#: Its gradient is token-mean's full-batch gradient times a positive per-step scale (total tokens /
#: (rows x max_new_tokens)), and with ``1 / p`` weights its estimate is unbiased (core/unbiased.py).
SKIP_DEFAULT_AGG = "seq-mean-token-sum-norm"
#: ``history``'s settings behind ``grpo-parts train`` when not given (the measured fastest arm,
#: ``cppo+skip_strong_fewer``): a lower exploration base that adapts twice as fast towards a 15%
#: zero-variance share, and the step rolls out only the prompts it keeps (cheaper steps). The
#: frameworks train whole steps of a fixed prompt count, so behind them a skip is filled (the
#: skipper's own defaults, GRESO's rule).
STRONG_RULE: dict[str, Any] = {"keep_base": 0.3, "base_step": 0.02, "target_share": 0.15}
TRAIN_HISTORY_KWARGS: dict[str, Any] = {**STRONG_RULE, "step_size": "fewer"}


def skip_default_loss(loss: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """``loss`` (its fields as given) with :data:`SKIP_DEFAULT_AGG`; ``norm_constant`` as given, else
    ``max_new_tokens``."""
    return {**loss, "agg": SKIP_DEFAULT_AGG, "norm_constant": loss.get("norm_constant", max_new_tokens)}


def _given(section: Any) -> tuple[dict[str, Any], set[str]] | None:
    """A config section's fields as given and their names (None: not a section; its field reports)."""
    if section is None:
        return {}, set()
    if isinstance(section, dict):
        return dict(section), set(section)
    if isinstance(section, (LossConfig, PartsConfig)):
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


def apply_skip_defaults(data: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """``data`` (the config's fields as given, ``task`` filled in) with, when ``parts.prompt_skip`` is
    ``history``, :data:`TRAIN_HISTORY_KWARGS` under the given kwargs and skipping's loss when
    ``loss.agg`` is not given. ``max_new_tokens``: the field's default."""
    parts = _given(data.get("parts"))
    if parts is None:
        return data
    fields, _ = parts
    if fields.get("prompt_skip", "none") == "none":
        return data
    loss = _skip_loss(data, max_new_tokens)
    if loss is None:
        return data
    if fields["prompt_skip"] == "history":
        kwargs = fields.get("prompt_skip_kwargs") or {}
        if isinstance(kwargs, dict):  # else the field reports it
            fields["prompt_skip_kwargs"] = {**TRAIN_HISTORY_KWARGS, **kwargs}
    return {**data, "parts": fields, "loss": loss}
