"""Run a :class:`.plan.Plan`: each model call's layout built, one forward each, un-grouped, merged.

Nothing here decides anything. The forward selects this package's attention function
(:data:`KERNEL_NAME`) for its duration and checks every decoder layer received the layout
(:func:`grouped_forward`); :func:`probe_reasons` runs it once per model on a one-token probe.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from ...compat import register_attention_function, select_attention
from ...distributed import ranks_of
from ...errors import GRPOPartsError, NotSupportedError
from ...wrappers import inner_model, sharding
from ..protocol import LogprobBatch, LogprobOutput
from ..reference import completion_output
from .chunking import empty_call_batch
from .guard import layout_shortfall, model_kind, refusing
from .images import grid_images
from .layout import LAYOUT_KWARG, GroupedInputs, LayoutSettings, build_grids, build_grouped_inputs
from .padding_free import PaddingFreeLayout, build_padding_free_inputs
from .plan import Plan

#: name under which the attention function is registered with transformers
KERNEL_NAME = "grpo_shared_prefix"


def register_attention() -> str:
    """Register the attention function with transformers under :data:`KERNEL_NAME`, with the mask
    builder of the model's own implementation for forwards without the layout (``mask="own"``:
    the shared-prefix forward passes a 4-D placeholder mask, which no builder touches). Idempotent."""
    from .kernels import shared_prefix_attention

    register_attention_function(KERNEL_NAME, shared_prefix_attention, mask="own")
    return KERNEL_NAME


def grouped_forward(
    model: torch.nn.Module,
    grouped: GroupedInputs,
    images: dict[str, torch.Tensor] | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``model`` on the grid with the shared-prefix kernel selected (on a VLM, in its language model
    only: the vision tower keeps its own attention); the logits at ``grouped.keep``. ``images`` /
    ``position_ids``: a VLM grid's image keywords and positions (:func:`.images.grid_images`).
    Raises :class:`NotSupportedError` when a decoder layer did not receive the layout."""
    b = grouped.input_ids.shape[0]
    placeholder = torch.ones(b, 1, 1, 1, dtype=torch.bool, device=grouped.input_ids.device)
    try:
        with select_attention(model, KERNEL_NAME):
            out = model(
                input_ids=grouped.input_ids,
                position_ids=grouped.position_ids if position_ids is None else position_ids,
                attention_mask=placeholder,  # 4-D: transformers passes it through instead of building a mask
                logits_to_keep=grouped.keep,
                use_cache=False,
                **{LAYOUT_KWARG: grouped.layout},
                **(images or {}),
            )
    except (GRPOPartsError, torch.OutOfMemoryError):
        raise  # our own refusals name their cause already; running out of memory is not the architecture
    except Exception as e:  # noqa: BLE001 - whatever the layout breaks inside a model is a refusal
        raise NotSupportedError(
            "shared_prefix",
            [f"model: {model_kind(model)} failed under the shared-prefix layout: {type(e).__name__}: {e}"],
        ) from e
    shortfall = layout_shortfall(model, grouped.layout.receipts)
    if shortfall:
        raise NotSupportedError("shared_prefix", shortfall)
    return out.logits


def ungroup_logits(kept_logits: torch.Tensor, grouped: GroupedInputs) -> torch.Tensor:
    """``[B, K, V]`` logits at ``grouped.keep`` -> ``[N, S, V]`` logits predicting each completion
    token. The last prefix token's logit is gathered once per completion of its group, so in
    backward the prefix receives the gradient of all of them."""
    return kept_logits[grouped.row_group.unsqueeze(-1), grouped.row_keep]


@dataclass
class PlanRun:
    """One run of ``plan`` on ``model``; :meth:`__call__` returns the output. ``attention_calls``
    counts the padding-free attention calls per path, ``masked_why`` says why a masked kernel ran."""

    model: torch.nn.Module
    plan: Plan
    temperature: float
    compute_entropy: bool
    attention_calls: Counter[str] = field(default_factory=Counter)
    masked_why: list[str] = field(default_factory=list)

    def __call__(self, batch: LogprobBatch) -> LogprobOutput:
        plan = self.plan
        if plan.group_index is not batch.group_index:  # sub-groups (packed=True)
            batch = replace(batch, group_index=plan.group_index)
        one = len(plan.calls) == 1 and not plan.empty_calls
        top = None if one else plan.facts.max_span - 1
        batches = [batch] if one else batch.split(plan.calls)
        empty = [empty_call_batch(batch)] * plan.empty_calls if plan.empty_calls else []
        with refusing("building the layout", self.model):  # inputs only: the logits come one call at a time
            if plan.layout == "padding_free":
                built = [build_padding_free_inputs(batches[0], plan.settings.build, top)]
                built += build_grids(empty, plan.settings.build, top)
            else:
                built = build_grids(batches + empty, plan.settings.build, top)
        outs = [self._call(b, g, self.compute_entropy) for b, g in zip(batches, built)]
        if one:
            return outs[0]
        # empty calls (other ranks run more): in the graph times zero, so their backward runs too
        zero = sum(self._call(b, g, False).logprobs.sum() * 0.0 for b, g in zip(empty, built[len(batches) :]))
        with refusing("un-grouping the calls", self.model):
            back = torch.argsort(torch.cat(plan.calls))
            logps = torch.cat([o.logprobs for o in outs])[back] + zero
            if not self.compute_entropy:
                return LogprobOutput(logps, None)
            ents = torch.cat([o.entropies for o in outs if o.entropies is not None])[back]
            return LogprobOutput(logps, ents + zero)

    def _call(self, batch: LogprobBatch, grouped: GroupedInputs, entropy: bool) -> LogprobOutput:
        """One model call on ``batch``, laid out as ``grouped``."""
        images, pos = grid_images(self.model, batch, grouped) if batch.vision is not None else (None, None)
        # raises NotSupportedError for what the model breaks
        kept = grouped_forward(self.model, grouped, images, pos)
        if isinstance(grouped.layout, PaddingFreeLayout):  # its attention calls per path
            masks = grouped.layout.masks
            self.attention_calls.update(masks.calls)
            self.masked_why += [w for w in masks.why if w not in self.masked_why]
        with refusing("un-grouping the logits", self.model):
            logits = ungroup_logits(kept, grouped)
            return completion_output(
                logits, batch.completion_ids, batch.completion_mask, self.temperature, entropy
            )


#: model -> reasons found by the one-token probe (``[]``: every decoder layer got the layout)
_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, list[str]] = weakref.WeakKeyDictionary()


def _sharded(model: torch.nn.Module) -> bool:
    """Whether a forward needs other processes (ZeRO-3 / FSDP / a process group) or has no weights
    here (meta): then the probe is left to the first real forward, which every rank runs."""
    if ranks_of() > 1 or sharding(model) is not None:
        return True
    return any(p.device.type == "meta" for p in model.parameters())


def probe_reasons(model: torch.nn.Module) -> list[str]:
    """Run ``model`` once on a one-token prompt and a one-token completion through the shared-prefix
    kernel (``eager``, no grad, eval mode; the modules' training flags are restored) and return why
    the layout did not reach every decoder layer (empty: it did). Cached per model; skipped (``[]``)
    for a model sharded across processes, where the first real forward checks the same."""
    key = inner_model(model)  # (``model`` may be a fresh CallsThrough view of it)
    if key in _PROBED:
        return _PROBED[key]
    if _sharded(model):
        return []
    register_attention()
    p = next(model.parameters())
    tok = torch.ones(1, 1, dtype=torch.long, device=p.device)
    batch = LogprobBatch(tok, tok, tok, tok, torch.zeros(1, dtype=torch.long, device=p.device))
    grouped = build_grouped_inputs(batch, LayoutSettings(kernel="eager"))
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            grouped_forward(model, grouped)
        reasons: list[str] = []
    except GRPOPartsError as e:  # NotSupportedError included: grouped_forward names the cause
        reasons = getattr(e, "reasons", None) or [f"model: {model_kind(model)}: {e}"]
    finally:
        for m, t in flags:
            m.training = t
    _PROBED[key] = reasons
    return reasons
