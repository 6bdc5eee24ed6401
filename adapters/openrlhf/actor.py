"""A grpo_parts :class:`~grpo_parts.attention.protocol.AttentionBackend` inside OpenRLHF's ``Actor.forward``.

OpenRLHF builds its ``Actor`` inside Ray actors (``PolicyModelActor``, ``ReferenceModelActor``), so
the backend is attached to the built instance: :func:`attach_attention` switches its class to
:class:`GRPOPartsActor`, whose ``forward`` takes the same arguments and returns the same
``action_log_probs: [B, A]`` (and ``output.entropy: [B, T-1]`` when asked), computed by the
backend on the rows regrouped by prompt (:mod:`.layout`). Padded and ``packing_samples`` actors
get the same call: OpenRLHF packs inside ``forward``, and the backend does its own layout.

Calls the backend cannot serve (ring attention, multimodal inputs, full-logit requests) run
OpenRLHF's own forward; :attr:`GRPOPartsActor.fallbacks` counts them by reason.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from openrlhf.models import Actor

from grpo_parts.errors import NotSupportedError

from .layout import scatter_to_openrlhf, to_logprob_batch


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DeepSpeed (``.module``) and PEFT (``get_base_model()``) wrappers:
    backends call it with keyword arguments its ``forward`` declares (``logits_to_keep``)."""
    from transformers import PreTrainedModel

    m = module
    for _ in range(4):
        if isinstance(m, PreTrainedModel):
            return m
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()  # type: ignore[operator]  # PEFT
            continue
        inner = getattr(m, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        m = inner
    return m


class GRPOPartsActor(Actor):
    """OpenRLHF ``Actor`` computing action log-probs with a grpo_parts backend. Build with
    :func:`attach_attention`, not directly."""

    grpo_backend: Any
    fallbacks: Counter[str]

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
        plain = dict(
            return_output=return_output,
            allgather_logits=allgather_logits,
            return_logprobs=return_logprobs,
            ring_attn_group=ring_attn_group,
            packed_seq_lens=packed_seq_lens,
            return_entropy=return_entropy,
            **mm_inputs,
        )
        reasons = self._call_reasons(
            action_mask, return_logprobs, allgather_logits, ring_attn_group, mm_inputs
        )
        if attention_mask is None:
            reasons.append("no attention_mask")
        layout = None if reasons else to_logprob_batch(sequences, attention_mask, action_mask)  # type: ignore[arg-type]
        if layout is None:
            self.fallbacks.update(reasons or ["no row has an action token"])
            return super().forward(sequences, action_mask, attention_mask, **plain)
        assert action_mask is not None
        out = self.grpo_backend.completion_logprobs(
            hf_model(self.model), layout.batch, temperature=self.temperature, compute_entropy=return_entropy
        )
        lp = out.logprobs if out.logprobs.dtype == torch.float64 else out.logprobs.float()
        action_log_probs = scatter_to_openrlhf(lp, layout, action_mask.shape[1]) * action_mask.to(lp.dtype)
        if not return_output:
            return action_log_probs
        from transformers.modeling_outputs import CausalLMOutput

        output = CausalLMOutput()
        if return_entropy:
            ent = out.entropies if out.entropies.dtype == torch.float64 else out.entropies.float()
            output.entropy = scatter_to_openrlhf(ent, layout, sequences.shape[1] - 1)
        return action_log_probs, output


def attach_attention(actor: Actor, backend: Any) -> GRPOPartsActor:
    """Make ``actor`` (an OpenRLHF ``Actor``, already built and wrapped) compute its action log-probs
    with ``backend``. Raises :class:`NotSupportedError` when the backend refuses the model."""
    reasons = list(backend.not_supported_reasons(hf_model(actor.model)))
    cfg = getattr(hf_model(actor.model), "config", None)
    if cfg is not None and getattr(cfg, "output_router_logits", False):
        reasons.append("MoE router aux loss (output_router_logits) needs the model's full output")
    if reasons:
        raise NotSupportedError(getattr(backend, "name", type(backend).__name__), reasons)
    actor.__class__ = GRPOPartsActor
    actor.grpo_backend = backend  # type: ignore[attr-defined]
    actor.fallbacks = Counter()  # type: ignore[attr-defined]
    return actor  # type: ignore[return-value]
