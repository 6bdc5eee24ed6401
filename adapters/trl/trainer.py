"""``GRPOPartsTrainer``: TRL 1.16's ``GRPOTrainer`` with grpo_parts' parts in its seams (``None``: TRL's own
path): ``sampler`` -> ``_generate_single_turn``; ``attention`` -> ``_get_per_token_logps_and_entropies``
(:mod:`.rows`); ``filter``, ``prompt_skip`` -> ``_generate_and_score_completions`` (:mod:`.filtering`,
:mod:`.skipping`); calls and fallbacks in TRL's metrics. docs/adapters/trl.md, "Where each part plugs in"."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from grpo_parts.attention.protocol import RankAgreeing
from grpo_parts.build import build_attention, build_part, choose_attention
from grpo_parts.compat import select_attention
from grpo_parts.counters import ATTENTION_CALLS, PartCounters, attention_calls
from grpo_parts.distributed import ranks_of
from grpo_parts.doors.agreement import agree_fallback
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.filter.protocol import WeighsLoss
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams, image_prompt_reasons
from grpo_parts.types import VisionInputs
from grpo_parts.wrappers import calls_through

from .filtering import FilterSeam
from .options import (
    PART_KEYWORDS,
    TOOL_IMAGES,
    PartsConfig,
    TRLPartsOptions,
    attention_config_reasons,
    check_trl_version,
    filter_config_reasons,
    group_rows_reasons,
    sampler_config_reasons,
    trl_parts,
    weighted_filter_reasons,
)
from .rows import prompt_runs, regroup_microbatches, regrouped_logprobs
from .skipping import accept_skipper

logger = logging.getLogger(__name__)

#: metric name of each part and what one call of it is
COUNTED = {"sampler": "rollouts", "attention": "forwards", "filter": "calls"}


@contextmanager
def _training(model: torch.nn.Module) -> Iterator[None]:
    """Check a backend against the model as TRL trains it (train mode: e.g. attention dropout)."""
    was = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was)


class GRPOPartsTrainer(FilterSeam):
    """``GRPOTrainer(*args, **kwargs)`` plus the part keywords (:data:`~.options.PART_KEYWORDS`: ``sampler``,
    ``draft``, ``attention``, ``filter``, ``prompt_skip``, each ``None``, a registered name or an instance,
    with ``*_kwargs`` for construction by name), ``parts`` (:class:`PartsConfig`) and ``parts_options``."""

    def __init__(
        self,
        *args: Any,
        parts: PartsConfig | dict[str, Any] | None = None,
        parts_options: TRLPartsOptions | None = None,
        **kwargs: Any,
    ) -> None:
        options = parts_options or TRLPartsOptions()
        check_trl_version(options)  # before TRL's own set-up: the seams below are private methods
        config, kw = trl_parts(parts, {k: kwargs.pop(k) for k in PART_KEYWORDS if k in kwargs})
        super().__init__(*args, **kwargs)
        self.parts_options = options
        #: the one parts configuration (grpo_parts.parts_config), as every door reads it
        self.parts_config = config
        self.parts_refused: dict[str, list[str]] = {}
        self.parts_choice: dict[str, str] = {}  # how "auto" chose
        self._gp_counters = PartCounters(COUNTED, logger)
        self._gp_off: dict[str, str] = {}
        self._gp_deferring = False
        self._gp_deferred: list[tuple[torch.Tensor, tuple[Any, ...]]] = []
        self._gp_rewards_per_func: torch.Tensor | None = None
        self._gp_stream: Iterator[dict[str, Any]] | None = None
        policy = self.accelerator.unwrap_model(self.model)

        self.gp_sampler = self._gp_build_sampler(
            policy, kw["sampler"], kw["draft"], kw["sampler_kwargs"], kw["draft_kwargs"]
        )
        a = self._gp_build_attention(policy, kw["attention"], kw["attention_kwargs"])
        a_reasons = attention_config_reasons(self)
        if a is not None and not a_reasons:
            with _training(policy):
                a_reasons = list(a.not_supported_reasons(policy))
        self.gp_attention = self._gp_accept("attention", a, a_reasons)

        f = build_part("filter", kw["filter"], policy, kwargs=kw["filter_kwargs"])
        f_reasons = filter_config_reasons(self, config)
        if isinstance(f, WeighsLoss):  # dppo: its weights ride on the advantages (.filtering)
            f_reasons += weighted_filter_reasons(self, config)
        self.gp_filter = self._gp_accept("filter", f, f_reasons)
        self.gp_skipper = accept_skipper(self, kw["prompt_skip"], kw["prompt_skip_kwargs"])
        self._gp_group_rows = self._gp_resolve_group_rows()

    def _gp_build_sampler(
        self,
        policy: torch.nn.Module,
        sampler: Any,
        draft: Any,
        sampler_kwargs: dict[str, Any] | None,
        draft_kwargs: dict[str, Any] | None,
    ) -> Any:
        """The sampler (with its draft) built and checked against this trainer, or None."""
        if draft is not None and not isinstance(sampler, str):
            raise GRPOPartsError("draft: only used with a sampler given by name (e.g. sampler='speculative')")
        d = build_part("draft", draft, policy, kwargs=draft_kwargs, where="draft_kwargs")
        skw = dict(sampler_kwargs or {})
        if isinstance(sampler, str) and "draft" in skw:
            d = skw.pop("draft")  # a draft instance in sampler_kwargs, as before
        s = build_part("sampler", sampler, policy, kwargs=skw, draft=d, where="sampler_kwargs")
        s_reasons = sampler_config_reasons(self)
        if s is not None and self._is_vlm:
            s_reasons += image_prompt_reasons(s)
        if s is not None and not s_reasons:
            s_reasons = list(
                s.not_supported_reasons(self._gp_sampling_params(int(self.num_generations or 1)))
            )
        return self._gp_accept("sampler", s, s_reasons)

    def _gp_build_attention(self, policy: torch.nn.Module, spec: Any, kwargs: dict[str, Any] | None) -> Any:
        if spec == "auto":
            return self._gp_auto_attention(policy, kwargs)
        return build_part("attention", spec, policy, kwargs=kwargs, where="attention_kwargs")

    def _gp_auto_attention(self, policy: torch.nn.Module, kwargs: dict[str, Any] | None) -> Any:
        """``attention="auto"``: the backend :func:`grpo_parts.build.choose_attention` picks (checked in
        train mode), built, or ``None`` when TRL's config rules every backend out. Any but the first of
        ``AUTO_PRIORITY`` is logged at WARNING with the reasons; its forwards count as fallbacks."""
        why = "; ".join(attention_config_reasons(self))
        if why:
            self.parts_choice["attention"] = "TRL's own forward: " + why
            self._gp_off["attention"] = "attention='auto' uses TRL's own forward: " + why
            self._gp_counters.note("attention", self._gp_off["attention"])
            return None
        with _training(policy):
            choice, chosen_kwargs = choose_attention(policy, kwargs, logger=logger)
        self.parts_choice["attention"] = choice.explain()
        if choice.refused:  # not the first of AUTO_PRIORITY
            refused = "; ".join(f"{n} refused: {', '.join(r)}" for n, r in choice.refused.items())
            self._gp_off["attention"] = f"attention='auto' chose {choice.name!r} ({refused})"
            self._gp_counters.note("attention", self._gp_off["attention"])
        return build_attention(choice.name, policy, kwargs=chosen_kwargs)

    def _gp_accept(self, part: str, obj: Any, reasons: list[str]) -> Any:
        if obj is None:
            return None
        self._gp_counters.track(part)
        if not reasons:
            return obj
        name = getattr(obj, "name", type(obj).__name__)
        if self.parts_options.strict:
            raise NotSupportedError(f"{part} {name!r} on this GRPOTrainer", reasons)
        self.parts_refused[part] = reasons
        self._gp_off[part] = f"{part} {name!r} not applied, TRL's own path is used: " + "; ".join(reasons)
        self._gp_counters.note(part, self._gp_off[part])
        return None

    def _gp_resolve_group_rows(self) -> bool:
        """Whether :meth:`_prepare_inputs` re-cuts TRL's micro-batches by prompt group."""
        want = self.parts_config.group_rows
        loss, steps = group_rows_reasons(self)
        if want and loss:
            if self.parts_options.strict:
                raise NotSupportedError("parts.group_rows=True", loss)
            self.parts_refused["group_rows"] = loss
            logger.warning(
                "grpo_parts: group_rows=True not applied, TRL's order is kept: %s", "; ".join(loss)
            )
            return False
        if want is not None:
            return want
        if self.gp_attention is not None and (loss or steps):
            logger.info(
                "grpo_parts: group_rows off (TRL's micro-batches kept, so the loss is TRL's): %s",
                "; ".join(loss + steps),
            )
            return False
        return self.gp_attention is not None

    def _gp_flush(self, mode: str) -> None:
        for key, value in self._gp_counters.flush(mode).items():
            self._metrics[mode][key].append(value)

    def _gp_sampling_params(self, group_size: int) -> SamplingParams:
        return SamplingParams(
            group_size=group_size,
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
            eos_token_ids=tuple(int(t) for t in self.eos_token_ids),
            pad_token_id=int(self._tokenizer.pad_token_id),
        )

    # ------------------------------------------------------------------------------------- sampler

    @contextmanager
    def _gp_no_draft_training(self, mode: str) -> Iterator[None]:
        """Eval rollouts must not train an online draft (speculative sampler's ``config.train_draft``)."""
        cfg = getattr(self.gp_sampler, "config", None)
        if mode == "train" or not getattr(cfg, "train_draft", False):
            yield
            return
        self.gp_sampler.config = cfg.model_copy(update={"train_draft": False})  # type: ignore[union-attr]
        try:
            yield
        finally:
            self.gp_sampler.config = cfg  # type: ignore[union-attr]

    def _generate(self, prompts):  # type: ignore[no-untyped-def]
        out = super()._generate(prompts)
        self._gp_count("sampler", served=self.gp_sampler is not None)  # one rollout of a batch
        return out

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):  # type: ignore[no-untyped-def]
        if self.gp_sampler is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if has_tool_images:
            raise NotSupportedError("sampler", ["tool responses with images: " + TOOL_IMAGES])
        counts = [len(i) if i else 0 for i in images] if images is not None else None
        rows = VisionInputs.per_row(
            {**multimodal_fields, "num_images": counts}, len(prompt_ids)
        ) if images is not None else None  # fmt: skip
        unique, group_size = prompt_runs(prompt_ids, num_generations, rows)
        params = self._gp_sampling_params(group_size)
        vision = None if rows is None else VisionInputs(rows.per_prompt[::group_size])
        policy = self.accelerator.unwrap_model(self.model)
        self.gp_sampler.sync_weights(policy)
        mode = self._gp_mode()
        was_training = policy.training
        policy.eval()  # no dropout while sampling, as transformers.generate
        try:
            # no torch.no_grad() here: samplers disable grad themselves, and an online draft trains
            # (with grad) at the end of generate, on this rollout, before the policy update
            with self._gp_no_draft_training(mode):
                batch = PromptBatch.from_lists(unique, params.pad_token_id)
                rollout = self.gp_sampler.generate(replace(batch, vision=vision), params)
        finally:
            policy.train(was_training)
        self._gp_log("sampler", rollout.stats)
        lengths = rollout.completion_mask.long().sum(-1).tolist()
        ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths)]
        logps = [row[:n] for row, n in zip(rollout.logprobs.tolist(), lengths)]
        return ids, logps

    # ------------------------------------------------------------------------------------- attention

    def _get_per_token_logps_and_entropies(  # type: ignore[no-untyped-def]
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        if self._gp_deferring and not torch.is_grad_enabled() and not (compute_entropy or compute_aux_loss):
            # old-policy / reference forward inside TRL's scoring: postpone it to after the filter
            placeholder = torch.zeros(input_ids.shape[0], logits_to_keep, device=input_ids.device)
            call = (model, input_ids, attention_mask, logits_to_keep, batch_size, multimodal)
            self._gp_deferred.append((placeholder, call))
            return placeholder, None, None
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy)
        if self.gp_attention is None:
            self._gp_count("attention", served=False)
            return super()._get_per_token_logps_and_entropies(*args, compute_aux_loss, **multimodal)
        if compute_aux_loss:
            raise NotSupportedError("attention", ["TRL passed compute_aux_loss: no MoE aux loss"])
        # each row's images from TRL's multimodal keywords (the backends rebuild the token flags from
        # the placeholder tokens; a model that takes token_type_ids is refused at set-up)
        images: VisionInputs | None = None
        reason: str | None = None
        try:
            images = VisionInputs.per_row(multimodal, input_ids.shape[0])
        except GRPOPartsError as e:
            reason = str(e)
        if reason and self.parts_options.strict:
            raise NotSupportedError("attention", [reason])
        reason = self._gp_agreed_fallback(attention_mask[:, -logits_to_keep:], reason)
        if reason:
            self._gp_counters.fell_back("attention", reason, mode=self._gp_mode())
            return super()._get_per_token_logps_and_entropies(*args, compute_aux_loss, **multimodal)
        self._gp_count("attention", served=True)
        before = attention_calls(self.gp_attention)  # padding-free kernels: parts/attention/calls_<path>
        with self.accelerator.autocast():
            logps, ents = regrouped_logprobs(
                self.gp_attention,
                # the model inside DeepSpeed's engine / DDP, every call through the wrapper TRL passed
                calls_through(model, self.accelerator.unwrap_model(model)),
                input_ids,
                attention_mask,
                logits_to_keep,
                self.temperature,
                compute_entropy,
                batch_size,
                images,
            )
        ran = attention_calls(self.gp_attention) - before
        self._gp_log("attention", {ATTENTION_CALLS + k: v for k, v in ran.items()})
        return logps, ents, None

    def _gp_agreed_fallback(self, completion_mask: torch.Tensor, reason: str | None = None) -> str | None:
        """Why this call runs TRL's own forward -- ``reason`` (this rank's own, e.g. an image layout it cannot
        split), or every completion masked -- else None: under grad ``backward`` needs a graph, and with
        several processes every rank falls back when any does (every rank must make the same model calls)."""
        dead = not bool(completion_mask.any())
        group = self.gp_attention.rank_group if isinstance(self.gp_attention, RankAgreeing) else None
        every = (
            "a batch whose every completion is masked (mask_truncated_completions) on this or another "
            "data-parallel rank: every rank runs TRL's own forward for it"
        )
        if reason is None and dead and ranks_of(group) > 1:
            reason = every
        elif reason is None and dead and torch.is_grad_enabled():
            reason = (
                "a micro-batch whose every completion is masked (mask_truncated_completions) runs TRL's "
                "own forward, so that backward has a graph"
            )
        return agree_fallback(reason, 0, group, completion_mask.device, other=every)[0]

    @contextmanager
    def _gp_kernel_scope(self) -> Iterator[None]:
        """Keep the backend's attention function on the policy for a whole training step: gradient
        checkpointing re-runs the layers in ``backward``, after the backend's own scope ended. Outside a
        backend forward the kernel behaves as the default."""
        name = self.gp_attention.register_kernel() if self.gp_attention is not None else None
        if not name:
            yield
            return
        with select_attention(self.accelerator.unwrap_model(self.model), name):
            yield

    def _prepare_inputs(self, generation_batch):  # type: ignore[no-untyped-def]
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self._gp_group_rows or self._gp_mode() != "train" or self._buffered_inputs is before:
            return inputs
        # TRL just generated, shuffled and split a new batch: keep each prompt's rows together
        gen = torch.Generator().manual_seed(int(self.args.seed) * 1_000_003 + int(self.state.global_step))
        self._buffered_inputs = regroup_microbatches(self._buffered_inputs, gen)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def training_step(self, model, inputs, num_items_in_batch):  # type: ignore[no-untyped-def]
        with self._gp_kernel_scope():
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self._step % self.current_gradient_accumulation_steps == 0:  # an optimizer step ends
            self._gp_flush("train")
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):  # type: ignore[no-untyped-def]
        out = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        self._gp_flush("eval")
        return out
