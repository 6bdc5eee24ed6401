"""Which grpo_parts run inside OpenRLHF, as one validated config.

The launcher adds ``--grpo_parts.*`` flags to OpenRLHF's own parser; OpenRLHF's ``hierarchize``
turns them into ``args.grpo_parts`` (a namespace), which travels to every Ray actor inside
``strategy.args``. :meth:`PartsConfig.from_args` reads it back there, so nothing depends on
environment variables or global state.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpo_parts.core import LossConfig
from grpo_parts.core.unbiased import Fact, WeightedLossFacts, refusal_reasons
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.protocol import WeighsLoss

#: flag name (after ``--grpo_parts.``) -> (type for argparse, default, help)
FLAGS: dict[str, tuple[type, Any, str]] = {
    "attention": (
        str,
        "reference",
        "AttentionBackend for actor/reference log-probs: reference | shared_prefix | auto",
    ),
    "attention_kwargs": (str, "{}", 'JSON kwargs for the attention backend, e.g. \'{"kernel": "sdpa"}\''),
    "filter": (str, "keep_all", "CompletionFilter applied after group advantages: keep_all | cppo | ..."),
    "filter_kwargs": (str, "{}", "JSON kwargs for the filter, e.g. '{\"pruning_rate\": 0.5}'"),
    "refill_rounds": (
        int,
        0,
        "max extra rollout rounds that refill slots freed by the filter (0 = no refill)",
    ),
    "filter_rounding": (
        str,
        "up",
        "make the kept rows a multiple of --train.batch_size (whole optimizer steps, equal rows per "
        "rank): up (re-add the best pruned rows) | down (drop the worst kept rows)",
    ),
    "grouped_microbatches": (
        str,
        "auto",
        "keep each prompt's completions in the same training micro-batch: auto (= on with a non-reference attention) | on | off",
    ),
    "speculative_config": (
        str,
        "",
        "JSON speculative_config passed to every vLLM engine (vLLM's own format)",
    ),
    "draft_sync": (str, "none", "draft weight sync after each policy update: none | shared (embed/lm_head)"),
    "check_first_batch": (
        int,
        0,
        "1 = on the policy's first forward also run OpenRLHF's own and log the largest log-prob "
        "difference (parts/attention/first_batch_logprob_max_abs_diff)",
    ),
}


def _json_dict(name: str, v: Any) -> dict[str, Any]:
    if isinstance(v, dict):
        return v
    if v in (None, ""):
        return {}
    try:
        out = json.loads(v)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: expected a JSON object, got {v!r} ({e})") from e
    if not isinstance(out, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(out).__name__}")
    return out


class PartsConfig(BaseModel):
    """The parts to use. Defaults reproduce plain OpenRLHF GRPO exactly."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: str = "reference"
    attention_kwargs: dict[str, Any] = Field(default_factory=dict)
    filter: str = "keep_all"
    filter_kwargs: dict[str, Any] = Field(default_factory=dict)
    refill_rounds: int = Field(0, ge=0)
    filter_rounding: str = "up"
    grouped_microbatches: str = "auto"
    speculative_config: dict[str, Any] = Field(default_factory=dict)
    draft_sync: str = "none"
    check_first_batch: bool = False

    @field_validator("attention_kwargs", "filter_kwargs", "speculative_config", mode="before")
    @classmethod
    def _parse_json(cls, v: Any, info: Any) -> dict[str, Any]:
        return _json_dict(info.field_name, v)

    @field_validator("draft_sync")
    @classmethod
    def _draft_sync(cls, v: str) -> str:
        if v not in ("none", "shared"):
            raise ValueError(f"draft_sync: expected 'none' or 'shared', got {v!r}")
        return v

    @field_validator("filter_rounding")
    @classmethod
    def _rounding(cls, v: str) -> str:
        if v not in ("up", "down"):
            raise ValueError(f"filter_rounding: expected 'up' or 'down', got {v!r}")
        return v

    @field_validator("grouped_microbatches")
    @classmethod
    def _grouped(cls, v: str) -> str:
        if v not in ("auto", "on", "off"):
            raise ValueError(f"grouped_microbatches: expected 'auto', 'on' or 'off', got {v!r}")
        return v

    def use_grouped_microbatches(self, dynamic_batch: bool) -> bool:
        if self.grouped_microbatches == "on" and dynamic_batch:
            raise GRPOPartsError("grouped_microbatches=on: not with --train.dynamic_batch_enable")
        if self.grouped_microbatches == "auto":
            return self.attention != "reference" and not dynamic_batch
        return self.grouped_microbatches == "on"

    @classmethod
    def from_args(cls, args: Any) -> PartsConfig:
        """Read ``args.grpo_parts`` (absent = defaults, i.e. plain OpenRLHF)."""
        ns = getattr(args, "grpo_parts", None)
        if ns is None:
            return cls()
        return cls(**{k: v for k, v in vars(ns).items() if v is not None})

    # ----------------------------------------------------------------------------- builders

    def build_filter(self) -> Any:
        """The filter named by ``filter``, by :func:`grpo_parts.build.build_filter`."""
        from grpo_parts.build import build_filter

        return build_filter(self.filter, kwargs=self.filter_kwargs, where="grpo_parts.filter_kwargs")

    def build_attention(self, model: torch.nn.Module | None = None) -> Any:
        """The backend named by ``attention``, by :func:`grpo_parts.build.build_attention`; ``"auto"``
        needs ``model`` and walks ``AUTO_PRIORITY`` (``attention_kwargs`` go to the backends that take
        them)."""
        from grpo_parts.build import build_attention

        return build_attention(
            self.attention, model, kwargs=self.attention_kwargs, where="grpo_parts.attention_kwargs"
        )


def weighted_filter_reasons(filt: Any, args: Any, refill_rounds: int) -> list[str]:
    """Why OpenRLHF cannot train the weighted filter ``filt`` (``dppo``: kept rows weighted ``1 / p``)
    unbiased under ``args`` (empty for a plain filter). The experience maker multiplies each kept
    row's per-token advantage by its weight times ``kept rows / rolled-out rows`` -- exact for
    OpenRLHF's PPO / GSPO / dual-clip losses (positively homogeneous in the advantage) and its
    per-step sequence count (whole ``--train.batch_size`` steps); what cannot stay so is refused."""
    if not isinstance(filt, WeighsLoss):
        return []
    normaliser: list[Fact] = []
    if args.actor.loss_agg_mode != "seq-mean-token-mean":
        normaliser.append((f"--actor.loss_agg_mode {args.actor.loss_agg_mode}", "OpenRLHF divides each optimizer step by its own kept tokens; use seq-mean-token-mean"))  # fmt: skip
    if args.train.dynamic_batch_enable:
        normaliser.append(("--train.dynamic_batch_enable", "steps of varying row counts, normalised by their own rows; turn it off"))  # fmt: skip
    unscaled: list[Fact] = []
    kl = float(args.algo.kl.init_coef or 0.0)
    if kl > 0 and args.algo.kl.use_loss:
        unscaled.append(("--algo.kl.use_loss", "put the KL in the reward (drop --algo.kl.use_loss)"))
    if args.actor.entropy_coef:
        unscaled.append((f"--actor.entropy_coef {args.actor.entropy_coef}", "use 0"))
    if float(getattr(args.actor, "aux_loss_coef", 0.0) or 0.0) > 1e-8:
        unscaled.append(("--actor.aux_loss_coef", "the MoE aux loss; use 0"))
    facts = WeightedLossFacts(
        source="dppo",
        refill=("--grpo_parts.refill_rounds > 0", "use 0") if refill_rounds > 0 else None,
        unscaled=tuple(unscaled),
        normaliser_from_draw=tuple(normaliser),
    )
    reasons = refusal_reasons(facts)
    if (
        kl > 0 and not args.algo.kl.use_loss
    ):  # KL in the reward: scaled with the advantage, but rows with A = 0 still carry it
        reasons += filt.loss_not_supported_reasons(LossConfig(kl_coef=kl))
    return reasons
