"""``GRPOPartsTrainer``: TRL 1.16's ``GRPOTrainer`` with grpo_parts' parts plugged into its seams.

Each part is optional and independent (``None`` = TRL's own code path, untouched):

* ``sampler``  -> ``_generate_single_turn`` (TRL's plain ``transformers.generate`` path). The sampler's
  ``Rollout.stats`` (e.g. speculative acceptance) go to ``self._metrics[mode]["parts/sampler/..."]``.
  A learnable draft is trained by the speculative sampler right after each training rollout, before
  the policy update (FastGRPO's "one step behind"); the adapter switches that off for eval rollouts.
* ``attention`` -> ``_get_per_token_logps_and_entropies`` (policy, old-policy and reference
  log-probs). Rows arrive shuffled and chunked by TRL; they are regrouped by prompt content.
* ``completion_filter`` -> ``_generate_and_score_completions``: after TRL's advantages, every
  per-row entry of the batch is sliced to the kept rows, ``num_items_in_batch`` is recomputed from
  the kept tokens, and the kept count is made a multiple of ``steps_per_generation``
  (see :class:`~.options.TRLPartsOptions`). Training batches only; eval batches are not filtered.

No maths lives here: advantages and losses are TRL's, log-probs are the backend's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from trl import GRPOTrainer

from grpo_parts.attention.shared_prefix import select_attention
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.filter.allocation import Chunk, Refiller
from grpo_parts.filter.apply import select_rows
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.types import ScoredBatch

from .build import build_part
from .options import (
    TRLPartsOptions,
    attention_config_reasons,
    filter_config_reasons,
    sampler_config_reasons,
)
from .rows import concat_batches, prompt_runs, regroup_chunks, regrouped_logprobs, round_kept

logger = logging.getLogger(__name__)


class GRPOPartsTrainer(GRPOTrainer):
    """``GRPOTrainer(*args, **kwargs)`` plus ``sampler``, ``draft``, ``attention``,
    ``completion_filter`` (each ``None``, a registered name, or an instance), their ``*_kwargs``
    for construction by name, and ``parts_options``."""

    def __init__(
        self,
        *args: Any,
        sampler: Any = None,
        draft: Any = None,
        attention: Any = None,
        completion_filter: Any = None,
        sampler_kwargs: dict[str, Any] | None = None,
        draft_kwargs: dict[str, Any] | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        filter_kwargs: dict[str, Any] | None = None,
        parts_options: TRLPartsOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.parts_options = parts_options or TRLPartsOptions()
        self.parts_refused: dict[str, list[str]] = {}
        self.parts_choice: dict[str, str] = {}  # how "auto" chose
        self._gp_deferring = False
        self._gp_deferred: list[tuple[torch.Tensor, tuple[Any, ...]]] = []
        self._gp_rewards_per_func: torch.Tensor | None = None
        self._gp_stream: Iterator[dict[str, Any]] | None = None
        policy = self.accelerator.unwrap_model(self.model)

        if sampler is not None and draft is not None and isinstance(sampler, str):
            sampler_kwargs = {
                "draft": build_part("draft", draft, policy, draft_kwargs),
                **(sampler_kwargs or {}),
            }
        elif draft is not None:
            raise GRPOPartsError("draft: only used with a sampler given by name (e.g. sampler='speculative')")
        s = build_part("sampler", sampler, policy, sampler_kwargs)
        s_reasons = sampler_config_reasons(self)
        if s is not None and not s_reasons:
            s_reasons = list(
                s.not_supported_reasons(self._gp_sampling_params(int(self.num_generations or 1)))
            )
        self.gp_sampler = self._gp_accept("sampler", s, s_reasons)

        if attention == "auto":
            attention = self._gp_auto_attention(policy, attention_kwargs)
        a = build_part("attention", attention, policy, attention_kwargs)
        a_reasons = attention_config_reasons(self)
        if a is not None and not a_reasons:
            a_reasons = list(a.not_supported_reasons(policy))
        self.gp_attention = self._gp_accept("attention", a, a_reasons)

        f = build_part("completion_filter", completion_filter, policy, filter_kwargs)
        self.gp_filter = self._gp_accept(
            "completion_filter", f, filter_config_reasons(self, self.parts_options)
        )

    # ------------------------------------------------------------------------------------- helpers

    def _gp_auto_attention(self, policy: torch.nn.Module, kwargs: dict[str, Any] | None) -> str | None:
        """``attention="auto"``: the first backend of ``AUTO_PRIORITY`` that supports this trainer
        and model; ``None`` (TRL's own forward) when TRL's config rules every backend out."""
        from grpo_parts.attention import AUTO_PRIORITY, IMPLEMENTATIONS
        from grpo_parts.registry import choose

        if attention_config_reasons(self):
            self.parts_choice["attention"] = "TRL's own forward: " + "; ".join(attention_config_reasons(self))
            return None
        choice = choose(
            IMPLEMENTATIONS,
            AUTO_PRIORITY,
            "attention",
            lambda cls: list(cls(**(kwargs or {})).not_supported_reasons(policy)),
        )
        self.parts_choice["attention"] = choice.explain()
        return choice.name

    def _gp_accept(self, part: str, obj: Any, reasons: list[str]) -> Any:
        if obj is None or not reasons:
            return obj
        name = getattr(obj, "name", type(obj).__name__)
        if self.parts_options.strict:
            raise NotSupportedError(f"{part} {name!r} on this GRPOTrainer", reasons)
        self.parts_refused[part] = reasons
        logger.warning(
            "grpo_parts: %s %r not applied, TRL's own path is used: %s", part, name, "; ".join(reasons)
        )
        return None

    def _gp_mode(self) -> str:
        return "train" if self.model is not None and self.model.training else "eval"

    def _gp_log(self, prefix: str, stats: dict[str, Any]) -> None:
        for k, v in stats.items():
            self._metrics[self._gp_mode()][f"parts/{prefix}/{k}"].append(float(v))

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

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):  # type: ignore[no-untyped-def]
        if self.gp_sampler is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if images is not None or multimodal_fields:
            raise NotSupportedError(
                "sampler", ["got images / multimodal fields: grpo_parts samplers are text-only"]
            )
        unique, group_size = prompt_runs(prompt_ids, num_generations)
        params = self._gp_sampling_params(group_size)
        policy = self.accelerator.unwrap_model(self.model)
        self.gp_sampler.sync_weights(policy)
        mode = self._gp_mode()
        was_training = policy.training
        policy.eval()  # no dropout while sampling, as transformers.generate
        try:
            # no torch.no_grad() here: samplers disable grad themselves, and an online draft trains
            # (with grad) at the end of generate, on this rollout, before the policy update
            with self._gp_no_draft_training(mode):
                rollout = self.gp_sampler.generate(
                    PromptBatch.from_lists(unique, params.pad_token_id), params
                )
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
        if (
            self._gp_deferring
            and not torch.is_grad_enabled()
            and not compute_entropy
            and not compute_aux_loss
        ):
            # old-policy / reference forward inside TRL's scoring: postpone it to after the filter
            placeholder = torch.zeros(input_ids.shape[0], logits_to_keep, device=input_ids.device)
            call = (model, input_ids, attention_mask, logits_to_keep, batch_size, multimodal)
            self._gp_deferred.append((placeholder, call))
            return placeholder, None, None
        if self.gp_attention is None:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        used = sorted(k for k, v in multimodal.items() if v is not None)
        if compute_aux_loss or used:
            raise NotSupportedError(
                "attention", [f"TRL passed {used or ['compute_aux_loss']}: text-only, no MoE aux loss"]
            )
        with self.accelerator.autocast():
            logps, ents = regrouped_logprobs(
                self.gp_attention,
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                self.temperature,
                compute_entropy,
                batch_size,
            )
        return logps, ents, None

    @contextmanager
    def _gp_kernel_scope(self) -> Iterator[None]:
        """Keep the backend's attention function selected on the policy for a whole training step.

        A backend selects its kernel only around its own forward; with gradient checkpointing the
        layers are re-run during ``backward``, after that scope ended, and would recompute with the
        model's default attention. Outside a backend forward the kernel must behave as the default
        (the shared-prefix kernel falls back to SDPA when no layout is passed)."""
        name = self.gp_attention.register_kernel() if self.gp_attention is not None else None
        if not name:
            yield
            return
        with select_attention(self.accelerator.unwrap_model(self.model), name):
            yield

    def _prepare_inputs(self, generation_batch):  # type: ignore[no-untyped-def]
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        group_rows = self.parts_options.group_rows
        if group_rows is None:
            group_rows = self.gp_attention is not None
        if not group_rows or self._gp_mode() != "train" or self._buffered_inputs is before:
            return inputs
        # TRL just generated, shuffled and split a new batch: keep each prompt's rows together
        gen = torch.Generator().manual_seed(int(self.args.seed) * 1_000_003 + int(self.state.global_step))
        self._buffered_inputs = regroup_chunks(self._buffered_inputs, gen)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def training_step(self, model, inputs, num_items_in_batch):  # type: ignore[no-untyped-def]
        with self._gp_kernel_scope():
            return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------------------------- filter

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gp_rewards_per_func = rewards_per_func  # gathered [N_all, F]; the filter needs the rewards
        return rewards_per_func

    def _gp_can_defer(self) -> bool:
        if not self.parts_options.defer_logprobs:
            return False
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return False  # TRL uses the old log-probs inside scoring
        model = self.accelerator.unwrap_model(self.model)
        return not (self.beta != 0.0 and self.ref_model is None and hasattr(model, "peft_config"))

    def _gp_score(self, inputs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], ScoredBatch]:
        """TRL's generation + scoring of ``inputs`` with the no-grad forwards postponed."""
        self._gp_deferred, self._gp_deferring = [], self._gp_can_defer()
        self._gp_rewards_per_func = None
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._gp_deferring = False
        deferred: dict[str, Any] = {}
        for placeholder, call in self._gp_deferred:
            keys = [k for k, v in out.items() if v is placeholder]
            if len(keys) != 1:
                raise GRPOPartsError(
                    f"deferred log-probs: expected one batch key holding the placeholder, got {keys}"
                )
            deferred[keys[0]] = call
        self._gp_deferred = []
        n = out["completion_ids"].shape[0]
        rpf = self._gp_rewards_per_func
        if rpf is None:
            raise GRPOPartsError("rewards: TRL did not call _calculate_rewards during scoring")
        start = self.accelerator.process_index * n
        rewards = (rpf * self.reward_weights.to(rpf.device)).nansum(dim=1)[start : start + n]
        rows = torch.arange(n, device=rewards.device) + start
        lengths = self._gp_loss_mask(out).sum(-1)
        scored = ScoredBatch(
            rewards, out["advantages"].reshape(n, -1)[:, 0].float(), rows // self.num_generations, lengths
        )
        return out, deferred, scored

    @staticmethod
    def _gp_loss_mask(batch: dict[str, Any]) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]

    def _gp_next_prompts(self, n: int) -> list[dict[str, Any]]:
        if self._gp_stream is None:
            seed = self.parts_options.refill_seed
            self._gp_stream = self._gp_prompt_stream(self.args.seed + 1 if seed is None else seed)
        return [next(self._gp_stream) for _ in range(n)]

    def _gp_prompt_stream(self, seed: int) -> Iterator[dict[str, Any]]:
        gen = torch.Generator().manual_seed(seed)
        ds = self.train_dataset
        while True:
            for i in torch.randperm(len(ds), generator=gen).tolist():  # type: ignore[arg-type]
                yield ds[i]  # type: ignore[index]

    def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
        if self.gp_filter is None or self._gp_mode() != "train":
            return super()._generate_and_score_completions(inputs)
        opts, g = self.parts_options, self.num_generations
        out, deferred, scored = self._gp_score(inputs)
        n = scored.size
        chunks: list[Chunk[Any]] = [Chunk((out, deferred), scored, max(1, n // g))]
        if opts.refill:

            def produce(num_prompts: int) -> Chunk[Any] | None:
                if not produced:  # round 1 is the batch TRL's dataloader gave us
                    produced.append(True)
                    return chunks[0]
                extra = [copy.deepcopy(row) for row in self._gp_next_prompts(num_prompts) for _ in range(g)]
                o, d, s = self._gp_score(extra)
                chunks.append(Chunk((o, d), s, num_prompts))
                return chunks[-1]

            produced: list[bool] = []
            refiller = Refiller(
                target_size=opts.refill_target_size or n,
                initial_prompts=chunks[0].num_prompts,
                max_rounds=opts.max_refill_rounds,
                max_prompts=opts.max_refill_prompts,
            )
            outcome = refiller.fill(self.gp_filter, produce)
            kept_by_chunk = {id(sel.chunk): sel.kept for sel in outcome.selections}
            kept = [kept_by_chunk.get(id(c), torch.zeros(0, dtype=torch.long)) for c in chunks]
            info = dict(outcome.info)
        else:
            res = self.gp_filter.select(scored, None)
            kept, info = [res.kept], dict(res.info)
        kept, changed = round_kept(
            [c.scored for c in chunks], kept, self.args.steps_per_generation, opts.filter_remainder
        )
        parts = []
        for chunk, rows in zip(chunks, kept):
            if rows.numel() == 0:
                continue
            batch, calls = chunk.payload
            sub = select_rows(batch, rows, chunk.scored.size)
            for key, (model, ids, mask, keep, bs, mm) in calls.items():
                idx = rows.to(ids.device)
                with torch.no_grad():
                    sub[key] = self._get_per_token_logps_and_entropies(
                        model, ids[idx], mask[idx], keep, bs, **mm
                    )[0]
            parts.append(sub)
        batch = concat_batches(parts, int(self._tokenizer.pad_token_id))
        batch["num_items_in_batch"] = self.accelerator.gather(self._gp_loss_mask(batch).sum()).sum()
        total = sum(c.scored.size for c in chunks)
        num_kept = int(batch["completion_ids"].shape[0])
        info.update(kept_fraction=num_kept / total, num_kept=num_kept, rows_scored=total, rounding=changed)
        self._gp_log("filter", info)
        return batch
