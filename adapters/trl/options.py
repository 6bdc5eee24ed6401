"""Options of the TRL adapter and the config checks that say why a part cannot apply to a user's TRL
setup. No TRL import: the checks read plain ``GRPOTrainer`` attributes (``use_vllm``, ``_is_vlm``...),
so they run on a stand-in object in tests too."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from grpo_parts.core.unbiased import Fact, WeightedLossFacts, refusal_reasons
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.parts_config import KnownFields, PartsConfig


class TRLPartsOptions(KnownFields):
    """The settings only the TRL door has; which parts run and the shared settings are the one
    :class:`~grpo_parts.parts_config.PartsConfig` (``GRPOPartsTrainer(parts=...)``). ``strict``: raise
    :class:`~grpo_parts.errors.NotSupportedError` when a part cannot apply (``False``: log and leave that
    part of TRL untouched). ``defer_logprobs``: run the old-policy / reference forwards after the filter.
    ``refill_*``: the seeded refill stream over ``train_dataset``. ``allow_untested_trl``: try a TRL
    outside :data:`TESTED_TRL`, with a warning. docs/adapters/trl.md, "The filter's rules"."""

    strict: bool = True
    defer_logprobs: bool = True
    refill_target_size: int | None = Field(None, ge=1)
    max_refill_prompts: int | None = Field(None, ge=1)
    refill_seed: int | None = Field(
        None, description="seed of the refill prompt order (default: args.seed + 1)"
    )
    allow_untested_trl: bool = False


#: the part keywords of ``GRPOPartsTrainer`` / :func:`~.build.make_trainer`: the parts of the one
#: :class:`PartsConfig` (``sampler=``, ``filter=``, ... : its fields that have ``*_kwargs``) and those
PART_KEYWORDS = tuple(
    key for name in PartsConfig.model_fields if f"{name}_kwargs" in PartsConfig.model_fields
    for key in (name, f"{name}_kwargs")
)  # fmt: skip


def trl_parts(
    parts: PartsConfig | Mapping[str, Any] | None, keywords: Mapping[str, Any]
) -> tuple[PartsConfig, dict[str, Any]]:
    """This trainer's one :class:`PartsConfig` and the part keywords to build from. ``parts`` (the shared
    config) and the part keywords (:data:`PART_KEYWORDS`: a name or an instance) are two ways to give a
    setting; each setting may come from one of them only (both are refused with one line). An instance
    stays a keyword (the config records no name for it)."""
    given = (
        parts.model_dump(include=parts.model_fields_set)
        if isinstance(parts, PartsConfig)
        else dict(parts or {})
    )
    unknown = sorted(set(keywords) - set(PART_KEYWORDS))
    if unknown:
        raise GRPOPartsError(f"{unknown[0]}: not a part keyword; expected one of {list(PART_KEYWORDS)}")
    for key, value in keywords.items():
        if value is None:
            continue
        if key in given:
            raise GRPOPartsError(f"{key}: given both as parts.{key} and as the keyword {key}=; give one")
        if isinstance(value, (str, dict)):
            given[key] = value
    config = PartsConfig.for_door("trl", given)
    # what was given (a name, kwargs or an instance) is built; an unset part stays TRL's own (None)
    built = {key: getattr(config, key) if key in given else keywords.get(key) for key in PART_KEYWORDS}
    return config, built


#: TRL versions the adapter is tested with (it overrides private ``GRPOTrainer`` methods)
TESTED_TRL = ">=1.16,<1.17"
#: the private ``GRPOTrainer`` methods the adapter overrides or calls
TRL_SEAMS = (
    "_generate",
    "_generate_single_turn",
    "_get_per_token_logps_and_entropies",
    "_prepare_inputs",
    "_generate_and_score_completions",
    "_calculate_rewards",
)


def trl_version_reasons(version: str) -> list[str]:
    """Why this adapter is not known to work with TRL ``version`` (empty = tested)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = SpecifierSet(TESTED_TRL).contains(Version(version), prereleases=True)
    except InvalidVersion:
        ok = False
    if ok:
        return []
    return [
        f"TRL {version} is outside the tested range {TESTED_TRL}: the adapter overrides private GRPOTrainer "
        f"methods ({', '.join(TRL_SEAMS)}) whose behaviour may have changed; install trl{TESTED_TRL} or pass "
        "parts_options=TRLPartsOptions(allow_untested_trl=True) to try anyway"
    ]


def check_trl_version(options: TRLPartsOptions, version: str | None = None) -> None:
    """Refuse a TRL outside the tested range (or warn, with ``allow_untested_trl``)."""
    import trl  # here, not at the top: this module stays importable without TRL

    reasons = trl_version_reasons(trl.__version__ if version is None else version)
    if not reasons:
        return
    if not options.allow_untested_trl:
        raise NotSupportedError("grpo_parts_adapters.trl", reasons)
    logging.getLogger("grpo_parts_adapters.trl.trainer").warning(
        "grpo_parts: allow_untested_trl=True: %s", reasons[0]
    )


def group_rows_reasons(trainer: Any) -> tuple[list[str], list[str]]:
    """What re-cutting TRL's micro-batches by prompt group (``group_rows``) would change, ``(loss, steps)``:
    ``loss`` -- options whose loss depends on which rows share a micro-batch; ``steps`` -- the rows of one
    generation batch are spread over several optimizer steps, so which row trains in which step would
    change. Both empty: the same loss, gradients and parameters as TRL's own order, up to float rounding."""
    args = _get(trainer, "args")
    loss = []
    q = _get(trainer, "top_entropy_quantile", 1.0)
    if q is not None and q < 1.0:
        loss.append(
            f"top_entropy_quantile={q}: TRL takes the entropy quantile over each micro-batch's tokens"
        )
    coef, adaptive = _get(trainer, "entropy_coef", 0.0), _get(trainer, "use_adaptive_entropy", False)
    if coef or adaptive:
        loss.append(
            f"entropy bonus (entropy_coef={coef}, use_adaptive_entropy={adaptive}): TRL averages the entropy "
            "over each micro-batch"
        )
    if _get(trainer, "loss_type") == "bnpo":
        loss.append("loss_type='bnpo': TRL normalises the loss by each micro-batch's token count")
    steps = []
    spg, ga = _get(args, "steps_per_generation", 1), _get(args, "gradient_accumulation_steps", 1)
    if spg is not None and ga is not None and spg > ga:
        steps.append(
            f"steps_per_generation={spg} > gradient_accumulation_steps={ga}: each generation batch is spread "
            "over several optimizer steps"
        )
    return loss, steps


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default)


#: why the sampler refuses TRL's tool-calling loop when tool responses carry images
TOOL_IMAGES = "images inside completions are not served yet (docs/adapters/trl.md, 'Vision-language models')"


def sampler_config_reasons(trainer: Any) -> list[str]:
    """Why a grpo_parts sampler cannot replace TRL's generation for this trainer (empty = it can): it
    replaces ``_generate_single_turn``'s plain ``transformers.generate`` path, sampling in-process from the
    training model with TRL's temperature / top-p / top-k."""
    reasons = []
    args = _get(trainer, "args")
    if _get(trainer, "use_vllm", False):
        mode = _get(args, "vllm_mode", "?")
        reasons.append(
            f"use_vllm=True (vllm_mode={mode!r}): TRL generates in a vLLM engine/server, while a grpo_parts "
            "sampler generates in-process with the training model; set use_vllm=False or sampler=None"
        )
    if _get(trainer, "use_transformers_continuous_batching", False):
        reasons.append("use_transformers_continuous_batching=True: set it to False or sampler=None")
    if _get(trainer, "rollout_func") is not None:
        reasons.append(
            "rollout_func is set: TRL calls it instead of _generate_single_turn; drop one of the two"
        )
    if _get(trainer, "min_p") is not None:
        reasons.append(
            f"min_p={_get(trainer, 'min_p')}: not implemented by grpo_parts samplers; set min_p=None"
        )
    rp = _get(trainer, "repetition_penalty", 1.0)
    if rp is not None and rp != 1.0:
        reasons.append(f"repetition_penalty={rp}: not implemented by grpo_parts samplers; set it to 1.0")
    extra = dict(_get(args, "generation_kwargs") or {})
    if extra:
        reasons.append(
            f"args.generation_kwargs={sorted(extra)}: only temperature/top_p/top_k/max_completion_length are "
            "honoured by grpo_parts samplers; remove generation_kwargs"
        )
    if _get(trainer, "temperature", 1.0) <= 0:
        reasons.append(f"temperature={_get(trainer, 'temperature')}: TRL samples; expected > 0")
    return reasons


def attention_config_reasons(trainer: Any) -> list[str]:
    """Why a grpo_parts attention backend cannot compute this trainer's log-probs."""
    if not _get(trainer, "aux_loss_enabled", False):
        return []
    return ["MoE router aux loss (router_aux_loss_coef): TRL needs the router logits of its own forward"]


def filter_config_reasons(trainer: Any, parts: PartsConfig) -> list[str]:
    """Why a completion filter cannot prune this trainer's generation batches."""
    reasons = []
    if parts.refill_rounds:
        acc = _get(trainer, "accelerator")
        if acc is not None and _get(acc, "num_processes", 1) > 1:
            reasons.append(
                "refill_rounds > 0 with several processes: each process would roll out a different number of rounds "
                "and TRL's collective gathers would hang; use refill_rounds=0 (or a larger generation_batch_size)"
            )
        ds = _get(trainer, "train_dataset")
        if ds is not None and not hasattr(ds, "__getitem__"):
            reasons.append(
                "refill_rounds > 0 needs a map-style train_dataset (an IterableDataset cannot be re-drawn)"
            )
    return reasons


#: TRL loss types whose normaliser is each micro-batch's row count (equal micro-batches): a weighted
#: filter folds ``kept rows / rolled-out rows`` into its weights to make it the full batch's
ROW_NORMALISED_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")
#: TRL loss types normalised by ``num_items_in_batch``, which the adapter sets to the full batch's tokens
TOKEN_NORMALISED_LOSSES = ("dapo", "cispo", "vespo")


def unscaled_terms(trainer: Any) -> tuple[Fact, ...]:
    """The loss terms of this trainer that a row weight carried by the advantage does not scale
    (for :func:`weighted_filter_reasons` and the prompt skipper's checks): the KL penalty, an entropy
    bonus, the MoE aux loss (facts of :mod:`grpo_parts.core.unbiased`)."""
    out: list[Fact] = []
    beta = _get(trainer, "beta", 0.0)
    if beta:
        out.append((f"beta={beta}", "TRL adds beta * KL per token; set beta=0.0"))
    coef, adaptive = _get(trainer, "entropy_coef", 0.0), _get(trainer, "use_adaptive_entropy", False)
    if coef or adaptive:
        out.append(
            (f"entropy bonus (entropy_coef={coef}, use_adaptive_entropy={adaptive})", "set entropy_coef=0.0")
        )
    if _get(trainer, "aux_loss_enabled", False):
        out.append(("MoE router aux loss", "disable the router aux loss"))
    return tuple(out)


def draw_dependent(trainer: Any) -> tuple[Fact, ...]:
    """Settings under which a row's loss depends on which rows were kept: the entropy quantile mask,
    taken over the trained rows of each micro-batch."""
    q = _get(trainer, "top_entropy_quantile", 1.0)
    if q is not None and q < 1.0:
        return (
            (f"top_entropy_quantile={q}", "the quantile is over each micro-batch's trained rows; set 1.0"),
        )
    return ()


def weighted_filter_reasons(trainer: Any, parts: PartsConfig) -> list[str]:
    """Why a weighted filter (``dppo``) cannot train this trainer's loss unbiased: the rule of
    :mod:`grpo_parts.core.unbiased` on TRL's facts (docs/filter.md, "Unbiased pruning (`dppo`)")."""
    loss = _get(trainer, "loss_type")
    normaliser = draw_dependent(trainer)
    if loss is not None and loss not in ROW_NORMALISED_LOSSES + TOKEN_NORMALISED_LOSSES:
        fix = f"TRL normalises it by each micro-batch's own token count; use one of {list(ROW_NORMALISED_LOSSES + TOKEN_NORMALISED_LOSSES)}"
        normaliser += ((f"loss_type={loss!r}", fix),)
    facts = WeightedLossFacts(
        source="dppo",
        refill=(f"parts.refill_rounds={parts.refill_rounds}", "set refill_rounds=0")
        if parts.refill_rounds
        else None,
        unscaled=unscaled_terms(trainer),
        normaliser_from_draw=normaliser,
    )
    return refusal_reasons(facts)
