"""A grpo_parts :class:`~grpo_parts.attention.protocol.AttentionBackend` inside OpenRLHF's ``Actor.forward``.

:class:`GRPOPartsActor` is OpenRLHF's ``Actor`` (built the same way, with the same arguments: the
grpo_parts model actors construct it where OpenRLHF constructs ``Actor``). Until
:meth:`GRPOPartsActor.use_backend` gives it a backend it *is* OpenRLHF's actor; afterwards its
``forward`` takes the same arguments and returns the same ``action_log_probs: [B, A]`` (and
``output.entropy: [B, T-1]`` when asked), computed by the backend on the rows regrouped by prompt
(:mod:`.layout`). Padded and ``packing_samples`` actors get the same call: OpenRLHF packs inside
``forward``, and the backend does its own layout.

Calls the backend cannot serve (ring attention, multimodal inputs, full-logit requests) run
OpenRLHF's own forward. :attr:`GRPOPartsActor.counters` counts both kinds per step
(``parts/attention/forwards``, ``parts/attention/fallbacks``; each reason logged once).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from openrlhf.models import Actor

from grpo_parts.attention.protocol import PLAN_GRID_SLOTS, CountsAttentionCalls
from grpo_parts.errors import NotSupportedError

from .._counters import PartCounters
from .._wrapped import backend_model, hf_model
from .layout import scatter_to_openrlhf, to_logprob_batch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _overhead(backend: Any, overhead: int | None) -> Iterator[None]:
    """The backend's ``chunk_overhead_tokens`` set to ``overhead`` for one call (None: unchanged)."""
    if overhead is None:
        yield
        return
    saved, backend.chunk_overhead_tokens = backend.chunk_overhead_tokens, overhead
    try:
        yield
    finally:
        backend.chunk_overhead_tokens = saved


def _another_rank_falls_back(device: torch.device, here: bool = False) -> bool:
    """With several processes (ZeRO-3 gathers parameters in every forward, so every rank must make
    the same number of model calls), whether any rank runs OpenRLHF's forward for this call: then all
    do. One all-reduce; False on one process."""
    from grpo_parts.attention.shared_prefix.chunking import agree_max, ranks_of

    if ranks_of() <= 1:
        return False
    return bool(agree_max([int(here)], None, device)[0])


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
        #: tokens of the shared-prefix calls since the last flush (:meth:`_bound`)
        self.tokens: Counter[str] = Counter()

    def use_backend(self, backend: Any) -> GRPOPartsActor:
        """Compute action log-probs with ``backend`` from now on (call after DeepSpeed wrapped the
        model). Raises :class:`NotSupportedError` when the backend refuses the model."""
        model = hf_model(self.model)
        reasons = list(backend.not_supported_reasons(model))
        if getattr(getattr(model, "config", None), "output_router_logits", False):
            reasons.append("MoE router aux loss (output_router_logits) needs the model's full output")
        if reasons:
            raise NotSupportedError(getattr(backend, "name", type(backend).__name__), reasons)
        self.grpo_backend = backend
        self.counters.track("attention")
        return self

    def _bound(self, layout: Any) -> tuple[Any, int | None, str | None]:
        """Bound the shared-prefix layout by the packed tokens. Unless the backend's ``layout`` is
        ``grid``, a call the backend lays out padding-free (each prompt once plus every action token,
        never more than the packed rows; ``SharedPrefixAttention.layout_for``: with ``auto``, of
        smaller estimated cost than its grids) keeps its prompt groups. Otherwise each prompt group is cut into
        sub-groups of similar completion length (:func:`grpo_parts.attention.shared_prefix.chunking.split_long_tails`,
        each at most its packed rows); when the backend's grid plan would still run more tokens than
        the packed rows, the plan splits into more grids (no per-forward overhead for this call), and
        when even that does not fit with ``--ds.packing_samples``, the call runs OpenRLHF's packed
        forward (counted). Returns ``(layout, chunk overhead for this call or None, fallback reason)``
        and adds to :attr:`tokens`."""
        from dataclasses import replace

        from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
        from grpo_parts.attention.shared_prefix.chunking import chunk_plan, split_long_tails

        backend = self.grpo_backend
        if not isinstance(backend, SharedPrefixAttention):
            return layout, None, None
        b = layout.batch
        plen, clen = b.prompt_mask.long().sum(-1), b.completion_mask.long().sum(-1)
        packed = int(plen.sum() + clen.sum())
        first = torch.zeros_like(b.group_index).scatter_reduce(
            0, b.group_index, plen, "amax", include_self=False
        )
        free = int(first[torch.unique(b.group_index)].sum() + clen.sum())
        most = backend.chunk_limit(hf_model(self.model))
        # the prompt groups as they are, where the backend lays them out padding-free (auto: of smaller
        # estimated cost than its grids, tokens and attention scores)
        if backend.layout != "grid" and backend.layout_for(hf_model(self.model), b)[0] == "padding_free":
            self.tokens.update(grid_tokens=free, packed_tokens=packed, padding_free_tokens=free)
            return layout, None, None
        batch = replace(b, group_index=split_long_tails(b.group_index, plen, clen))
        layout = replace(layout, batch=batch)
        overhead, grid = None, chunk_plan(batch, backend.chunk_overhead_tokens, most)[1][PLAN_GRID_SLOTS]
        if grid > packed:
            overhead, grid = 0, chunk_plan(batch, 0, most)[1][PLAN_GRID_SLOTS]
        self.tokens.update(grid_tokens=int(grid), packed_tokens=packed, padding_free_tokens=free)
        if self.packing_samples and grid > packed:
            return layout, None, f"grouped layout ({int(grid)} tokens) > packed micro-batch ({packed})"
        return layout, overhead, None

    def flush_tokens(self) -> dict[str, float]:
        """``parts/attention/{grid,packed,padding_free}_tokens`` since the last flush (then reset), and
        ``parts/attention/calls_<path>``: the backend's padding-free attention calls per path
        (``varlen_cascade``, ``masked_sdpa``, ...; ``SharedPrefixAttention.attention_calls``)."""
        out = {f"parts/attention/{k}": float(v) for k, v in self.tokens.items()}
        self.tokens.clear()
        backend = self.grpo_backend
        calls = Counter(backend.attention_calls if isinstance(backend, CountsAttentionCalls) else {})
        seen = self.__dict__.get("_calls_seen", Counter())
        out.update({f"parts/attention/calls_{k}": float(v) for k, v in (calls - seen).items()})
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
        if mm_inputs or getattr(self, "is_vlm", False):
            out.append("multimodal inputs")
        return out

    def _plan_call(
        self, sequences: torch.Tensor, action_mask: Any, attention_mask: Any, reasons: list[str]
    ) -> tuple[Any, int | None, list[str]]:
        """``(layout, chunk overhead, reasons)``: the call regrouped by prompt and bounded
        (:meth:`_bound`), or layout None and why OpenRLHF's forward runs it instead. ``reasons``: the
        caller's refusals so far. Every rank falls back together (:func:`_another_rank_falls_back`)."""
        if attention_mask is None:
            reasons.append("no attention_mask")
        layout = None if reasons else to_logprob_batch(sequences, attention_mask, action_mask)  # type: ignore[arg-type]
        overhead = None
        if layout is not None:
            layout, overhead, reason = self._bound(layout)
            reasons += [reason] if reason else []
        here = layout is None or bool(reasons)
        if _another_rank_falls_back(sequences.device, here=here) and not here:
            reasons = ["another data-parallel rank runs OpenRLHF's forward for this call"]
        if reasons:
            layout = None
        return layout, overhead, reasons

    def _backend_logprobs(
        self, layout: Any, overhead: int | None, action_mask: torch.Tensor, return_entropy: bool
    ) -> tuple[torch.Tensor, Any]:
        """``(action_log_probs [B, A], the backend's output)``: the backend's log-probs (float32, or
        float64 as computed) scattered back to OpenRLHF's action positions."""
        with _overhead(self.grpo_backend, overhead):
            out = self.grpo_backend.completion_logprobs(
                backend_model(self.model),
                layout.batch,
                temperature=self.temperature,
                compute_entropy=return_entropy,
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
        layout, overhead, reasons = self._plan_call(sequences, action_mask, attention_mask, reasons)
        if layout is None:
            self.counters.fell_back("attention", "; ".join(reasons or ["no row has an action token"]))
            return super().forward(sequences, action_mask, attention_mask, **plain_call)
        assert action_mask is not None
        self.counters.ran("attention")
        action_log_probs, out = self._backend_logprobs(layout, overhead, action_mask, return_entropy)
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
