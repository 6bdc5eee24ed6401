"""Which grpo_parts run inside OpenRLHF, as one validated config. The launcher adds ``--grpo_parts.*``
flags to OpenRLHF's parser; its ``hierarchize`` makes them ``args.grpo_parts``, which travels to every Ray
actor in ``strategy.args``, where :meth:`OpenRLHFPartsConfig.from_args` reads it back (no environment
variables, no global state)."""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from grpo_parts.core import AdvantageConfig, LossConfig
from grpo_parts.core.unbiased import Fact, WeightedLossFacts, refusal_reasons
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.protocol import WeighsLoss
from grpo_parts.parts_config import PartsConfig

#: OpenRLHF estimator -> the same advantage in grpo_parts terms (experience_maker.py, 0.11.2):
#: group_norm = (r - mean) / (std + 1e-9) with torch's unbiased std; dr_grpo = r - mean;
#: rloo = r - mean of the others. (reinforce_baseline whitens over the whole batch after filtering,
#: so a kept row's advantage would depend on the pruned ones: not offered here.)
ADVANTAGE_CONFIGS: dict[str, AdvantageConfig] = {
    "group_norm": AdvantageConfig(norm="group", unbiased_std=True, eps=1e-9),
    "dr_grpo": AdvantageConfig(norm="none"),
    "rloo": AdvantageConfig(estimator="rloo"),
}
#: ``--grpo_parts.group_rows`` -> ``PartsConfig.group_rows``
GROUP_ROWS = {"auto": None, "on": True, "off": False}

#: flag name (after ``--grpo_parts.``) -> (type for argparse, default, help)
FLAGS: dict[str, tuple[type, Any, str]] = {
    "attention": (
        str,
        "none",
        "AttentionBackend for actor/reference log-probs: none (OpenRLHF's own forward) | shared_prefix | "
        "reference (grpo_parts' reference backend, for checking) | auto",
    ),
    "attention_kwargs": (str, "{}", 'JSON kwargs for the attention backend, e.g. \'{"kernel": "sdpa"}\''),
    "filter": (str, "keep_all", "CompletionFilter applied after group advantages: keep_all | cppo | ..."),
    "filter_kwargs": (str, "{}", "JSON kwargs for the filter, e.g. '{\"pruning_rate\": 0.5}'"),
    "refill_rounds": (
        int,
        0,
        "max extra rollout rounds that refill slots freed by the filter (0 = no refill)",
    ),
    "kept_rounding": (
        str,
        "up",
        "make the kept rows a multiple of --train.batch_size (whole optimizer steps, equal rows per "
        "rank): up (re-add the best pruned rows) | down (drop the worst kept rows)",
    ),
    "group_rows": (
        str,
        "auto",
        "keep each prompt's completions in the same training micro-batch: auto (= on with an attention "
        "backend) | on | off",
    ),
    "speculative_config": (
        str,
        "",
        "JSON speculative_config passed to every vLLM engine (vLLM's own format)",
    ),
    "draft_sync": (str, "none", "draft weight sync after each policy update: none | shared (embed/lm_head)"),
    "prompt_skip": (
        str,
        "none",
        "skip prompts whose recent groups had zero reward variance before vLLM generates them: none | "
        "history (kept prompts weigh 1/p; needs --actor.loss_agg_mode seq-mean-token-mean)",
    ),
    "prompt_skip_kwargs": (str, "{}", "JSON kwargs for the prompt skipper, e.g. '{\"keep_base\": 0.3}'"),
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


#: shared settings this door does not offer -> what to use instead
NOT_OFFERED = {
    "sampler": "OpenRLHF generates in its vLLM engines: give --grpo_parts.speculative_config",
    "draft": "give the draft in --grpo_parts.speculative_config (vLLM's own format)",
}


class OpenRLHFPartsConfig(PartsConfig):
    """The one :class:`~grpo_parts.parts_config.PartsConfig` as the ``--grpo_parts.*`` flags give it,
    plus this door's own settings (``speculative_config``, ``draft_sync``, ``check_first_batch``).
    Defaults reproduce plain OpenRLHF. ``attention none`` = OpenRLHF's own forward; ``group_rows
    auto|on|off`` = None/True/False."""

    speculative_config: dict[str, Any] = Field(default_factory=dict)
    draft_sync: str = "none"
    check_first_batch: bool = False

    @model_validator(mode="before")
    @classmethod
    def _flags(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        if out.get("attention") in ("none", ""):
            out["attention"] = None  # OpenRLHF's own forward
        if isinstance(out.get("group_rows"), str):
            value = out["group_rows"]
            if value not in GROUP_ROWS:
                raise ValueError(f"group_rows: expected 'auto', 'on' or 'off', got {value!r}")
            out["group_rows"] = GROUP_ROWS[value]
        return out

    @field_validator(
        "attention_kwargs", "filter_kwargs", "prompt_skip_kwargs", "speculative_config", mode="before"
    )
    @classmethod
    def _parse_json(cls, v: Any, info: Any) -> dict[str, Any]:
        return _json_dict(info.field_name, v)

    @field_validator("draft_sync")
    @classmethod
    def _draft_sync(cls, v: str) -> str:
        if v not in ("none", "shared"):
            raise ValueError(f"draft_sync: expected 'none' or 'shared', got {v!r}")
        return v

    @model_validator(mode="after")
    def _offered(self) -> OpenRLHFPartsConfig:
        reasons = self.refusals("openrlhf", NOT_OFFERED)
        if reasons:
            raise ValueError(reasons[0])
        return self

    def use_grouped_microbatches(self, dynamic_batch: bool) -> bool:
        """``group_rows`` resolved: on with an attention backend unless OpenRLHF balances by tokens."""
        if self.group_rows and dynamic_batch:
            raise GRPOPartsError("group_rows=on: not with --train.dynamic_batch_enable")
        if self.group_rows is None:
            return self.attention is not None and not dynamic_batch
        return self.group_rows

    @classmethod
    def from_args(cls, args: Any) -> OpenRLHFPartsConfig:
        """Read ``args.grpo_parts`` (absent = defaults, i.e. plain OpenRLHF)."""
        ns = getattr(args, "grpo_parts", None)
        if ns is None:
            return cls()
        return cls(**{k: v for k, v in vars(ns).items() if v is not None})

    def build_filter(self) -> Any:
        """The filter named by ``filter``, by :func:`grpo_parts.build.build_filter`."""
        from grpo_parts.build import build_filter

        return build_filter(self.filter, kwargs=self.filter_kwargs, where="grpo_parts.filter_kwargs")

    def build_attention(self, model: torch.nn.Module | None = None) -> Any:
        """The backend named by ``attention``, by :func:`grpo_parts.build.build_attention`; ``"auto"`` needs
        ``model`` and walks ``AUTO_PRIORITY`` (``attention_kwargs`` go to the backends that take them)."""
        from grpo_parts.build import build_attention

        if self.attention is None:
            raise GRPOPartsError("attention: OpenRLHF's own forward has no backend to build")
        return build_attention(
            self.attention, model, kwargs=self.attention_kwargs, where="grpo_parts.attention_kwargs"
        )


def _normaliser_facts(args: Any) -> list[Fact]:
    """OpenRLHF settings under which a step's normaliser depends on which rows were trained."""
    out: list[Fact] = []
    if args.actor.loss_agg_mode != "seq-mean-token-mean":
        out.append((f"--actor.loss_agg_mode {args.actor.loss_agg_mode}", "OpenRLHF divides each optimizer step by its own kept tokens; use seq-mean-token-mean"))  # fmt: skip
    if args.train.dynamic_batch_enable:
        out.append(("--train.dynamic_batch_enable", "steps of varying row counts, normalised by their own rows; turn it off"))  # fmt: skip
    return out


def _unscaled_facts(args: Any) -> list[Fact]:
    """OpenRLHF loss terms a weight carried by the advantage does not scale."""
    out: list[Fact] = []
    if float(args.algo.kl.init_coef or 0.0) > 0 and args.algo.kl.use_loss:
        out.append(("--algo.kl.use_loss", "put the KL in the reward (drop --algo.kl.use_loss)"))
    if args.actor.entropy_coef:
        out.append((f"--actor.entropy_coef {args.actor.entropy_coef}", "use 0"))
    if float(getattr(args.actor, "aux_loss_coef", 0.0) or 0.0) > 1e-8:
        out.append(("--actor.aux_loss_coef", "the MoE aux loss; use 0"))
    return out


def _loss_facts(args: Any, refill_rounds: int, source: str, **kw: Any) -> WeightedLossFacts:
    """OpenRLHF's facts for the rule of :mod:`grpo_parts.core.unbiased` (``kw``: the source's own)."""
    return WeightedLossFacts(
        source=source,
        refill=("--grpo_parts.refill_rounds > 0", "use 0") if refill_rounds > 0 else None,
        unscaled=tuple(_unscaled_facts(args)),
        normaliser_from_draw=tuple(_normaliser_facts(args)),
        **kw,
    )


def skip_reasons(args: Any, refill_rounds: int) -> list[str]:
    """Why OpenRLHF cannot skip prompts with ``1 / p`` weights unbiased under ``args``: the rule of
    :mod:`grpo_parts.core.unbiased` on OpenRLHF's facts, plus the settings whose prompt stream the
    skipping stage does not own (OpenRLHF's own dynamic filtering, a vLLM batch larger than a step)."""
    reasons = refusal_reasons(_loss_facts(args, refill_rounds, "prompt skipping", normaliser="drawn"))
    if args.algo.dynamic_filtering_enable:
        reasons.append(
            "--algo.dynamic_filtering_enable: OpenRLHF's own filter re-draws prompts after the skip draw; turn it off"
        )
    gen = getattr(args.rollout, "vllm_generate_batch_size", None)
    if gen and int(gen) != int(args.rollout.batch_size):
        reasons.append(
            f"--rollout.vllm_generate_batch_size {gen}: a skip round is one step's prompts; leave it at --rollout.batch_size"
        )
    return reasons


def weighted_filter_reasons(filt: Any, args: Any, refill_rounds: int) -> list[str]:
    """Why OpenRLHF cannot train the weighted filter ``filt`` (``dppo``) unbiased under ``args`` (empty
    for a plain filter): the rule of docs/filter.md, "Unbiased pruning (`dppo`)", on OpenRLHF's losses
    and its per-step sequence count (whole ``--train.batch_size`` steps)."""
    if not isinstance(filt, WeighsLoss):
        return []
    kl = float(args.algo.kl.init_coef or 0.0)
    reasons = refusal_reasons(_loss_facts(args, refill_rounds, "dppo"))
    # KL in the reward: scaled with the advantage, but rows with A = 0 still carry it
    if kl > 0 and not args.algo.kl.use_loss:
        reasons += filt.loss_not_supported_reasons(LossConfig(kl_coef=kl))
    return reasons
