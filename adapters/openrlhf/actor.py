"""A grpo_parts ``AttentionBackend`` inside OpenRLHF's ``Actor.forward``: after
:meth:`GRPOPartsActor.use_backend`, ``forward`` returns the same ``action_log_probs: [B, A]`` (and
``output.entropy``), computed by the backend on the rows regrouped by prompt (:mod:`.layout`); calls it
cannot serve run OpenRLHF's own forward, counted. docs/adapters/openrlhf.md, "AttentionBackend"."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Any

import torch
from openrlhf.models import Actor

from grpo_parts.attention.protocol import CountsAttentionCalls, Plans
from grpo_parts.counters import (
    ATTENTION_CALLS,
    GRID_TOKENS,
    PACKED_TOKENS,
    PADDING_FREE_TOKENS,
    PartCounters,
    framework_keys,
)
from grpo_parts.doors.agreement import agree_fallback
from grpo_parts.doors.vision import image_groups, images_per_row
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.types import TOKEN_ALIGNED_KEYS, VISION_KEYS, VisionInputs
from grpo_parts.wrappers import calls_through, transformers_model

from .layout import scatter_to_openrlhf, to_logprob_batch

logger = logging.getLogger(__name__)


class GRPOPartsActor(Actor):
    """OpenRLHF's ``Actor`` (same constructor) that computes action log-probs with a grpo_parts
    attention backend once :meth:`use_backend` has given it one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grpo_backend: Any = None
        self.counters = PartCounters({"attention": "forwards"}, logger)
        #: compare the next backend forward with OpenRLHF's own (``first_batch_diff``, once)
        self.check_first_batch = False
        self.first_batch_diff: float | None = None
        #: tokens of the shared-prefix calls since the last flush (:meth:`_plan`)
        self.tokens: Counter[str] = Counter()

    def use_backend(self, backend: Any) -> GRPOPartsActor:
        """Compute action log-probs with ``backend`` from now on (call after DeepSpeed wrapped the
        model). Raises :class:`NotSupportedError` when the backend refuses the model."""
        model = transformers_model(self.model)
        reasons = list(backend.not_supported_reasons(model))
        if getattr(getattr(model, "config", None), "output_router_logits", False):
            reasons.append("MoE router aux loss (output_router_logits) needs the model's full output")
        if reasons:
            raise NotSupportedError(getattr(backend, "name", type(backend).__name__), reasons)
        self.grpo_backend = backend
        self.counters.track("attention")
        return self

    def _plan(self, layout: Any) -> tuple[Any, str | None]:
        """``(the backend's plan or None, fallback reason)`` for a call regrouped by prompt, planned as
        packed rows (the ranks agree afterwards, :meth:`_plan_call`); with ``--ds.packing_samples`` a plan
        that runs more tokens than the packed rows runs OpenRLHF's packed forward. Adds to :attr:`tokens`."""
        backend = self.grpo_backend
        if not isinstance(backend, Plans):
            return None, None
        # image prompts run in grids of whole prompts (never bounded as packed rows)
        rows_bound = layout.batch.vision is None
        plan = backend.plan(transformers_model(self.model), layout.batch, packed=rows_bound, agree=False)
        self.tokens[GRID_TOKENS] += int(plan.tokens)
        self.tokens[PACKED_TOKENS] += plan.packed_tokens
        self.tokens[PADDING_FREE_TOKENS] += plan.padding_free_tokens
        if self.packing_samples and plan.tokens > plan.packed_tokens:
            return (
                plan,
                f"grouped layout ({int(plan.tokens)} tokens) > packed micro-batch ({plan.packed_tokens})",
            )
        return plan, None

    def flush_tokens(self) -> dict[str, float]:
        """``parts/attention/{grid,packed,padding_free}_tokens`` since the last flush (then reset), and
        ``parts/attention/calls_<path>``: the backend's padding-free attention calls per path
        (``varlen_cascade``, ``masked_sdpa``, ...; ``SharedPrefixAttention.attention_calls``)."""
        out = framework_keys("attention", self.tokens)
        self.tokens.clear()
        backend = self.grpo_backend
        calls = Counter(backend.attention_calls if isinstance(backend, CountsAttentionCalls) else {})
        seen = self.__dict__.get("_calls_seen", Counter())
        out.update(framework_keys("attention", {ATTENTION_CALLS + k: v for k, v in (calls - seen).items()}))
        self.__dict__["_calls_seen"] = calls
        return out

    def _call_reasons(
        self,
        action_mask: Any,
        return_logprobs: bool,
        allgather_logits: bool,
        ring_attn_group: Any,
        mm_inputs: dict,
    ) -> list[str]:
        out = []
        if action_mask is None or return_logprobs:
            out.append("caller wants log-probs of every position (return_logprobs / no action_mask)")
        if allgather_logits:
            out.append("caller wants full logits (allgather_logits)")
        if ring_attn_group is not None:
            out.append("ring attention (--ds.ring_attn_size > 1) splits sequences across ranks")
        other = sorted(
            k for k, v in mm_inputs.items() if v is not None and k not in (*VISION_KEYS, *TOKEN_ALIGNED_KEYS)
        )
        if other:
            out.append(f"multimodal inputs {other}: an image layout grpo_parts does not split per row")
        return out

    def _images(self, sequences: torch.Tensor, attention_mask: Any, mm_inputs: dict) -> tuple[Any, list[str]]:
        """``(each row's images or None, reasons)``: OpenRLHF merges its samples' images flat; each
        row's share is read off its image tokens (:func:`grpo_parts.doors.vision.images_per_row`)."""
        if attention_mask is None or not any(mm_inputs.get(k) is not None for k in VISION_KEYS):
            return None, []
        model = transformers_model(self.model)
        try:
            counts = images_per_row(model, sequences, attention_mask, mm_inputs)
            return VisionInputs.per_row({**mm_inputs, "num_images": counts}, sequences.shape[0]), []
        except GRPOPartsError as e:
            return None, [str(e)]

    def _plan_call(
        self,
        sequences: torch.Tensor,
        action_mask: Any,
        attention_mask: Any,
        reasons: list[str],
        images: Any = None,
    ) -> tuple[Any, Any, list[str]]:
        """``(layout, plan, reasons)``: the call regrouped by prompt and planned (:meth:`_plan`), or layout
        None and why OpenRLHF's forward runs it instead (``reasons``: the caller's refusals so far). The ranks
        agree in one all-reduce (:func:`grpo_parts.doors.agreement.agree_fallback`): all fall back together,
        or all make as many model calls as the rank that makes the most (the plan padded with empty calls)."""
        if attention_mask is None:
            reasons.append("no attention_mask")
        layout = None if reasons else to_logprob_batch(sequences, attention_mask, action_mask)  # type: ignore[arg-type]
        if layout is not None and images is not None:  # rows share a group when tokens and images are equal
            gi, vision = image_groups(
                layout.batch.group_index,
                VisionInputs(tuple(images.per_prompt[r] for r in layout.rows.tolist())),
            )
            layout = replace(layout, batch=replace(layout.batch, group_index=gi, vision=vision))
        plan = None
        if layout is not None:
            plan, reason = self._plan(layout)
            reasons += [reason] if reason else []
        here = "; ".join(reasons) if layout is None or reasons else None
        calls = plan.model_calls if plan is not None and here is None else 1
        other = "another data-parallel rank runs OpenRLHF's forward for this call"
        anyone, calls = agree_fallback(here, calls, None, sequences.device, other)
        if anyone is not None:
            return None, None, reasons or [anyone]
        return layout, None if plan is None else plan.agreed(calls), reasons

    def _backend_logprobs(
        self, layout: Any, plan: Any, action_mask: torch.Tensor, return_entropy: bool
    ) -> tuple[torch.Tensor, Any]:
        """``(action_log_probs [B, A], the backend's output)``: the backend's log-probs (float32, or
        float64 as computed) scattered back to OpenRLHF's action positions; ``plan``: the agreed one
        of a backend that plans (None: its ``completion_logprobs``)."""
        model, backend = calls_through(self.model, transformers_model(self.model)), self.grpo_backend
        if plan is not None:
            out = backend.run(model, layout.batch, plan, self.temperature, return_entropy)
        else:
            out = backend.completion_logprobs(
                model, layout.batch, temperature=self.temperature, compute_entropy=return_entropy
            )
        lp = out.logprobs if out.logprobs.dtype == torch.float64 else out.logprobs.float()
        return scatter_to_openrlhf(lp, layout, action_mask.shape[1]) * action_mask.to(lp.dtype), out

    @staticmethod
    def _output(out: Any, layout: Any, seq_len: int, return_entropy: bool) -> Any:
        """OpenRLHF's ``output`` with ``entropy: [B, T-1]`` when asked."""
        from transformers.modeling_outputs import CausalLMOutput

        output = CausalLMOutput()
        if return_entropy:
            ent = out.entropies if out.entropies.dtype == torch.float64 else out.entropies.float()
            output.entropy = scatter_to_openrlhf(ent, layout, seq_len - 1)
        return output

    def forward(  # type: ignore[override]
        self,
        sequences: torch.LongTensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_output: bool = False,
        allgather_logits: bool = False,
        return_logprobs: bool = False,
        ring_attn_group: Any = None,
        packed_seq_lens: list[int] | None = None,
        return_entropy: bool = False,
        **mm_inputs: Any,
    ) -> Any:
        plain_call = dict(
            return_output=return_output,
            allgather_logits=allgather_logits,
            return_logprobs=return_logprobs,
            ring_attn_group=ring_attn_group,
            packed_seq_lens=packed_seq_lens,
            return_entropy=return_entropy,
            **mm_inputs,
        )
        if self.grpo_backend is None:
            return super().forward(sequences, action_mask, attention_mask, **plain_call)
        reasons = self._call_reasons(
            action_mask, return_logprobs, allgather_logits, ring_attn_group, mm_inputs
        )
        images, why = self._images(sequences, attention_mask, mm_inputs)
        reasons += why
        layout, plan, reasons = self._plan_call(sequences, action_mask, attention_mask, reasons, images)
        if layout is None:
            self.counters.fell_back("attention", "; ".join(reasons or ["no row has an action token"]))
            return super().forward(sequences, action_mask, attention_mask, **plain_call)
        assert action_mask is not None
        self.counters.ran("attention")
        action_log_probs, out = self._backend_logprobs(layout, plan, action_mask, return_entropy)
        if self.check_first_batch and self.first_batch_diff is None:
            self.first_batch_diff = self._diff_to_openrlhf(
                action_log_probs, sequences, action_mask, attention_mask, plain_call
            )
        if not return_output:
            return action_log_probs
        return action_log_probs, self._output(out, layout, sequences.shape[1], return_entropy)

    @torch.no_grad()
    def _diff_to_openrlhf(
        self, ours: torch.Tensor, sequences: Any, action_mask: Any, attention_mask: Any, call: dict
    ) -> float:
        """Largest ``|ours - OpenRLHF's own forward|`` over action tokens (logged once per run)."""
        call = {**call, "return_output": False, "return_entropy": False}
        plain = super().forward(sequences, action_mask, attention_mask, **call)
        diff = float(((ours.detach().float() - plain.float()) * action_mask).abs().max())
        logger.info("grpo_parts: first batch, largest log-prob difference to OpenRLHF's forward: %.3g", diff)
        return diff
